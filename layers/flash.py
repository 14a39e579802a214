"""TPU flash attention: jax's Pallas splash-attention kernel behind shardax's attention layout.

Why a kernel: XLA's dot-product attention materializes every [batch, heads, S, S] score
tensor (and keeps it, or its softmax, for the backward pass). A flash kernel streams K/V
blocks through on-chip memory with an online softmax and never holds the scores: memory
O(S) instead of O(S^2), which is what lets 8k-64k sequences fit
(docs/long_context.md).

Which kernel. jax ships `jax.experimental.pallas.ops.tpu.splash_attention` ("splash":
sparse flash attention, the kernel MaxText trains with): causal and local (sliding-window)
masks whose fully-masked blocks it skips, segment ids (packed documents), grouped-query
heads (k/v with fewer heads than q, never repeated in memory), a logit soft-cap, and its
own forward + dq + dkv backward kernels. It comes with the pinned jax (no new dependency,
versioned in lock-step with jax and libtpu) and lowers to a Mosaic `tpu_custom_call`
that the TPU compiler compiles ahead of time for a libtpu topology on this CPU (the
dry-run test checks it for v5e:2x2). tokamax (on the package index) wraps kernels of
the same family, but its releases that resolve with jax 0.10 are pinned to that jax, and
it adds a dependency for no feature we use; it was not adopted (not installed here).

Layout. shardax keeps q[b, l, n, d] and k/v[b, s, k, d]; the kernel takes one example with
heads first (q[n, l, d], k/v[k, s, d]), so `splash_local` vmaps it over the batch and swaps
axes. It scales q by d^-1/2 (the kernel does not scale), then applies the soft-cap to the
scaled logits, as `xla_attention` does.

Sharding. A Pallas call is opaque to the SPMD partitioner, which would replicate it (all-
gather the whole batch onto every chip). `sharded` therefore runs it under `shard_map` with
the layouts the logical rules give q/k/v (sharding/manual.py: batch and heads split as the
preset says), so each device runs the kernel on its own examples and heads. Model code names
no mesh axis: the layouts come from the rules. A split `length` is context parallelism, which
layers/context_parallel.py does (all-gathered K/V, then `sequence_kernel` per device:
see `SequenceMask`); `sharded` refuses it.

Block sizes (`flash_block_q`, `flash_block_kv`; also used by the backward kernels) default
to 512, MaxText's choice for v5e/v6e; a block is cut to the sequence length when shorter.
The kernel needs lengths that are multiples of 128 (one lane width) and of the block.

Numerics: tests/test_flash.py runs the kernel in Pallas interpret mode on the CPU against the
einsum path, forward and gradients (causal, 3 packed documents, GQA, window, soft-cap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sa_mask

from shardax.sharding import manual

LANES = 128   # kv blocks must be multiples of the vector lane width


def supports(q_len: int, kv_len: int) -> bool:
  """Whether the kernel takes these lengths (multiples of a lane; blocks are cut to fit)."""
  return q_len % LANES == 0 and kv_len % LANES == 0


def _block(block: int, length: int) -> int:
  """The largest multiple of 128 <= `block` dividing `length` (lengths are multiples of 128)."""
  b = min(block, length) // LANES * LANES
  while length % b:
    b -= LANES
  return b


def _kernel(num_heads: int, q_len: int, kv_len: int, causal: bool, window: int | None,
            softcap: float | None, block_q: int, block_kv: int, interpret: bool):
  """The splash kernel for one example's shapes and mask. Built per trace, not cached: its
  block-mask tables become arrays of the trace in progress (a scanned stack traces once)."""
  shape = (q_len, kv_len)
  if window is not None:   # keys i - window < j <= i (causal) or |i - j| < window
    mask = sa.LocalMask(shape, window_size=(window - 1, 0 if causal else window - 1), offset=0)
  elif causal:
    mask = sa.CausalMask(shape)
  else:
    mask = sa.FullMask(shape)
  return sa.make_splash_mha(sa.MultiHeadMask([mask] * num_heads),
                            block_sizes=_sizes(q_len, kv_len, block_q, block_kv),
                            head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap,
                            interpret=interpret)


def _sizes(q_len: int, kv_len: int, block_q: int, block_kv: int) -> sa.BlockSizes:
  bq, bkv = _block(block_q, q_len), _block(block_kv, kv_len)
  return sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                       block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                       block_q_dq=bq, block_kv_dq=bkv)


def _heads_first(kernel, q, k, v, q_seg, kv_seg):
  """`kernel` (one example, heads first) on q[b,l,n,d], k/v[b,s,k,d], q scaled by d^-1/2."""
  q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)

  def one(q1, k1, v1, qs, ks):
    seg = None if qs is None else sa.SegmentIds(q=qs, kv=ks)
    return kernel(q1.swapaxes(0, 1), k1.swapaxes(0, 1), v1.swapaxes(0, 1), segment_ids=seg).swapaxes(0, 1)

  if q_seg is None:
    return jax.vmap(lambda q1, k1, v1: one(q1, k1, v1, None, None))(q, k, v)
  return jax.vmap(one)(q, k, v, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32))


class SequenceMask(sa_mask._ComputableMask):
  """Causal (optionally sliding-window) mask by *real* sequence position, for query rows
  stored in any order: row r of q holds position `q_sequence[r]`, key column j position j.

  Context parallelism needs it: each device holds a slice of the rows (in the load-
  balanced order, chunks i and 2C-1-i), which the kernel's static masks (CausalMask's
  `offset` is one static shift) cannot describe for a device index known only at run
  time. splash evaluates a `_ComputableMask` from `q_sequence`, and when the kernel is
  made with `q_seq_shards=C` its block tables and `q_sequence` are arrays split along
  the rows; passed through shard_map, each device gets the tables of its own rows, so
  fully masked blocks are still skipped per device (MaxText's load-balanced causal mask
  is the same construction)."""

  def __init__(self, q_sequence: np.ndarray, kv_len: int, window: int | None = None):
    self.window = window

    def visible(q_ids, kv_ids):     # numpy when the tables are built, jnp inside the kernel
      mask = q_ids >= kv_ids
      return mask if window is None else mask & (q_ids - kv_ids < window)

    super().__init__((len(q_sequence), kv_len), visible)
    self.q_sequence = np.asarray(q_sequence, np.int32)

  def __eq__(self, other):
    return (type(other) is type(self) and self.shape == other.shape and self.window == other.window
            and np.array_equal(self.q_sequence, other.q_sequence))

  def __hash__(self):
    return hash((type(self), self.shape, self.window, self.q_sequence.tobytes()))


def sequence_kernel(num_heads: int, q_sequence: np.ndarray, kv_len: int, shards: int, *,
                    window: int | None, softcap: float | None, block_q: int, block_kv: int,
                    interpret: bool):
  """The splash kernel for global rows in the order `q_sequence` against `kv_len` keys in
  natural order, its tables split into `shards` row slices (`SequenceMask`). Pass it
  through shard_map with `kernel.manual_sharding_spec(...)` and call it per device with
  `run_sequence_kernel`."""
  q_len = len(q_sequence)
  if not supports(q_len // shards, kv_len):
    raise ValueError(f"model.attention='flash' with context parallelism needs each device's "
                     f"sequence slice ({q_len} / {shards} = {q_len // shards}) and the whole "
                     f"sequence to be multiples of {LANES}; set data.seq_len to a multiple of "
                     f"{LANES * shards} or model.attention='auto'")
  mask = SequenceMask(q_sequence, kv_len, window)
  return sa.make_splash_mha(sa.MultiHeadMask([mask] * num_heads),
                            block_sizes=_sizes(q_len // shards, kv_len, block_q, block_kv),
                            head_shards=1, q_seq_shards=shards, attn_logits_soft_cap=softcap,
                            interpret=interpret)


def run_sequence_kernel(kernel, q, k, v, q_seg, kv_seg):
  """One device's q[b,l,n,d] (its rows) against the whole k/v[b,s,k,d] (natural order)."""
  return _heads_first(kernel, q, k, v, q_seg, kv_seg)


def splash_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, *,
                 causal: bool = True, window: int | None = None, softcap: float | None = None,
                 block_q: int = 512, block_kv: int = 512, interpret: bool = False) -> jax.Array:
  """q[b,l,n,d], k/v[b,s,k,d] (one device's arrays) -> [b,l,n,d] by the splash kernel."""
  b, l, n, d = q.shape
  s = k.shape[1]
  if not supports(l, s):
    raise ValueError(f"model.attention='flash' needs sequence lengths that are multiples of "
                     f"{LANES}, got q {l} / kv {s}; set data.seq_len to a multiple of {LANES} "
                     f"or model.attention='auto' (falls back to 'xla')")
  kernel = _kernel(n, l, s, causal, window, softcap, block_q, block_kv, interpret)
  return _heads_first(kernel, q, k, v, segment_ids, segment_ids)


def sharded(local_fn, q: jax.Array, k: jax.Array, v: jax.Array,
            segment_ids: jax.Array | None) -> jax.Array:
  """`local_fn(q, k, v, segment_ids)` run per device in a manual region (sharding/manual.py),
  q [batch, length, heads, kv] and k/v [.., kv_heads, kv] cut as the logical rules in force say.

  Without a mesh or rules (or on one device) it is `local_fn` itself. When the rules split q
  heads but not kv heads (or differently), k/v are repeated to q's heads first, so each
  device's query heads meet their own kv heads (the grouping h -> h // g is kept)."""
  if not manual.active():
    return local_fn(q, k, v, segment_ids)
  q_axes = ("batch", "length", "heads", "kv")
  q_layout = manual.layout(q_axes, q.shape, name="flash attention q")
  kv_layout = manual.layout(("batch", "length", "kv_heads", "kv"), k.shape, name="flash attention k/v")
  if q_layout.axes[1] or q_layout.axes[3]:
    raise ValueError(f"flash attention: the rules split the sequence or head dim of q "
                     f"(spec {q_layout.spec}); a split 'length' is context parallelism "
                     f"(layers/context_parallel.py), not this kernel's sharding")
  if kv_layout.axes[2] != q_layout.axes[2] or kv_layout.axes[0] != q_layout.axes[0]:
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(t, groups, axis=2) for t in (k, v))
    kv_layout = q_layout
  seg_layout = q_layout.select(0, 1)
  return manual.run(local_fn, in_layouts=(q_layout, kv_layout, kv_layout, seg_layout),
                    out_layouts=q_layout)(q, k, v, segment_ids)
