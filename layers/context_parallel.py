"""Context parallelism: causal attention over a sequence split across devices.

When the rules map the logical `length` axis to mesh axes (the `*_cp` presets in
sharding/rules.py send it to `context`), every per-token layer (embedding, norms, MLP,
RoPE on the positions that travel with the tokens, the head and the loss) simply runs
on its own slice of the sequence. Attention is the one layer whose tokens meet tokens
of other devices, so it runs here, in `shard_map` (each operand split as the rules split it; the collectives run
over the `length` axes), in one of two modes (`model.context_parallel`):

  'allgather'  every device all-gathers K and V (and the segment ids) of the whole
               sequence and attends its own queries to them. One collective per layer
               (its transpose, a reduce-scatter of dK/dV, in the backward pass); K/V of
               the whole sequence live on every device for the layer's duration.
  'ring'       K/V blocks travel round the axis with `ppermute`: at step t device i
               holds the block of device (i - t) mod C, combines it into running
               softmax statistics (max m, sum l, unnormalized output: the log-sum-exp
               merge of flash attention), and has already issued the transfer of the
               next block before it computes on this one, so transfer and compute can
               overlap. Only two K/V blocks are held at once in the forward pass. The
               backward is jax's transpose of the loop (the permutes run in reverse);
               each step is rematerialized, so it saves the step's inputs (the K/V
               block and the running statistics), not its scores.

Load balance (causal). In natural order, device i of C holds tokens [i S/C, (i+1) S/C);
under a causal mask the last device attends to the whole prefix, the first to almost
nothing. So the model puts the sequence in the *balanced* order before the first layer
(`balance_batch`): cut into 2C chunks of n = S/2C tokens, device i holds chunks i and
2C-1-i. Every device then has the same number of visible (query, key) pairs, and whole
blocks are known empty from the chunk numbers alone: with 'allgather' the first local
chunk needs only the first half of the gathered keys; with 'ring', a block from an
earlier device is needed only by its first half of keys, one from a later device only
by its second half of queries, so each ring step does half the work of a dense block.

The reorder is applied to every per-token batch field (inputs, targets, positions,
segment ids, loss mask) together, so each token keeps its target, position and
document. Nothing needs undoing for training: the loss is a mean (or mask-weighted
sum) over tokens, which does not depend on their order. Masks are built from the real
sequence index of each token (which this module computes from the device index and the
layout) and the real segment ids, never from the local index: a query at sequence
index p sees key index s iff s <= p and both belong to the same segment, exactly the
single-device rule of layers/attention.py. A model that does not reorder (it does not
enter `sequence(..., balanced=True)`) gets the contiguous layout: still exact, only
unbalanced.

The per-block compute is `block_attention` (einsums, float32 logits and softmax
statistics): (q, k, v, q index, k index, q/k segment ids) -> (out, m, l), with the
window and soft-cap of the layer's AttentionOptions. When attention resolves to the
flash kernel (a TPU, or model.attention='flash'), 'allgather' runs the splash kernel on
each device's query rows against the gathered K/V instead (`_flash_allgather`).

Attention sinks (gpt-oss: a logit per query head in the softmax's denominator) enter once, at
the end: `finish` merges them into the running statistics as one more key block of value 0
(max s_h, sum 1), whichever mode and however many blocks came before. The splash kernel takes
no sink, so 'flash' with sinks is refused by name ('auto' keeps the einsum blocks).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from shardax.layers import flash
from shardax.layers.attention_choice import resolve
from shardax.layers.attention_scores import grouped_logits
from shardax.sharding import manual

MODES = ("allgather", "ring")

# Logical axes of the query activation; the `length` entry of its layout is the split.
_Q_AXES = ("batch", "length", "heads", "kv")
_NEG = float(jnp.finfo(jnp.float32).min)


class ContextParallelError(ValueError):
  """A sequence/mesh combination context parallelism cannot split; names the fix."""


@dataclasses.dataclass(frozen=True)
class Split:
  """How the current rules split the sequence: mesh `axes` of total `size` (C)."""
  axes: tuple[str, ...]
  size: int

  @property
  def axis_name(self):
    """What collectives take: the one axis name, or the tuple of them."""
    return self.axes[0] if len(self.axes) == 1 else self.axes


def length_split() -> Split | None:
  """The mesh axes the current rules map `length` to (for activations, whose batch dim
  comes first), or None with no mesh, no rules, or a split of size 1. Model code never
  names the axis: it is whatever the experiment's rules say."""
  q = manual.layout(_Q_AXES)
  size = q.parts(1)
  return Split(q.axes[1], size) if size > 1 else None


# (mode, balanced) of the sequence being traced; set by the model around its forward.
_sequence: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "shardax_context_parallel", default=("allgather", False))


@contextlib.contextmanager
def sequence(mode: str, balanced: bool) -> Iterator[None]:
  """Inside: attention over a split `length` uses `mode`, and the tokens are in the
  balanced order (`balanced=True`, after `balance_batch`) or the natural one."""
  check_mode(mode)
  token = _sequence.set((mode, balanced))
  try:
    yield
  finally:
    _sequence.reset(token)


def check_mode(mode: str) -> None:
  if mode not in MODES:
    raise ContextParallelError(f"model.context_parallel={mode!r}: use one of {MODES}")


def check_length(length: int, split: Split, balanced: bool) -> None:
  parts = 2 * split.size if balanced else split.size
  if length % parts:
    raise ContextParallelError(
        f"context parallelism over mesh axes {split.axes} (size {split.size}) cuts the "
        f"sequence into {parts} equal chunks{' (2 per device, for causal load balance)' if balanced else ''}, "
        f"but its length is {length}; set data.seq_len to a multiple of {parts}, or change "
        f"the mesh / the rule for 'length'")


# ----------------------------------------------------------------------------------------
# The balanced order.

def balanced_order(length: int, size: int) -> np.ndarray:
  """int[length]: the natural sequence index of each slot in the balanced order
  (device i's slots hold chunks i, then 2*size-1-i, of n = length / (2*size) tokens)."""
  n = length // (2 * size)
  chunks = [c for i in range(size) for c in (i, 2 * size - 1 - i)]
  return np.concatenate([np.arange(c * n, (c + 1) * n) for c in chunks])


def balance(x: jax.Array, size: int, axis: int = 1) -> jax.Array:
  """x with its `axis` (the sequence) put in the balanced order for `size` devices."""
  return jnp.take(x, jnp.asarray(balanced_order(x.shape[axis], size)), axis=axis)


def unbalance(x: jax.Array, size: int, axis: int = 1) -> jax.Array:
  """The inverse of `balance` (e.g. for logits a caller wants in natural order)."""
  inverse = np.argsort(balanced_order(x.shape[axis], size))
  return jnp.take(x, jnp.asarray(inverse), axis=axis)


def balance_batch(batch: dict, length_fields: tuple[str, ...] = (
    "inputs", "targets", "positions", "segment_ids", "loss_mask")) -> dict:
  """The batch in the balanced order when the current rules split `length`, else as is.

  Positions are made explicit first (0..S-1 per row) so RoPE still sees each token's
  real position after the move. Fields move together, so every token keeps its target,
  position, document and loss weight."""
  split = length_split()
  if split is None:
    return batch
  b, s = batch["inputs"].shape[:2]
  check_length(s, split, balanced=True)
  batch = dict(batch)
  if batch.get("positions") is None:
    batch["positions"] = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  return {k: balance(v, split.size) if k in length_fields and v is not None else v
          for k, v in batch.items()}


def local_index(device: jax.Array, local_len: int, size: int, balanced: bool) -> jax.Array:
  """int32[local_len]: the natural sequence index of each token device `device` holds."""
  r = jnp.arange(local_len, dtype=jnp.int32)
  if not balanced:
    return device * local_len + r
  n = local_len // 2
  chunk = jnp.where(r < n, device, 2 * size - 1 - device)
  return chunk * n + r % n


# ----------------------------------------------------------------------------------------
# Per-block compute and the softmax-statistics merge.

def block_attention(q, k, v, q_idx, k_idx, q_seg=None, k_seg=None, *, window=None, softcap=None):
  """One block of causal GQA: q[b,l,n,d] against k/v[b,s,kv,d].

  q_idx[l], k_idx[s]: real sequence indices (query p sees key s iff s <= p, and with a
  `window` iff also p - s < window); q_seg[b,l], k_seg[b,s]: segment ids (same document
  only), or None; `softcap`: logits -> cap * tanh(logits / cap) after the 1/sqrt(d) scale
  (attention_scores.grouped_logits). Returns the unnormalized output
  acc[b,kv,g,l,d] (float32), the row max m[b,kv,g,l] and the row sum l[b,kv,g,l] of
  exp(logit - m) over visible keys (0 where a row sees nothing in this block)."""
  logits = grouped_logits(q, k, softcap)
  mask = (q_idx[:, None] >= k_idx[None, :])[None]                    # [1, l, s]
  if window is not None:
    mask = mask & (q_idx[:, None] - k_idx[None, :] < window)[None]
  if q_seg is not None:
    mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])            # [b, l, s]
  mask = mask[:, None, None]
  logits = jnp.where(mask, logits, _NEG)
  m = jnp.max(logits, axis=-1)
  p = jnp.where(mask, jnp.exp(logits - m[..., None]), 0.0)
  acc = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return acc, m, jnp.sum(p, axis=-1)


def merge(state, block):
  """Two partial softmax results over disjoint key sets -> the result over their union."""
  acc0, m0, l0 = state
  acc1, m1, l1 = block
  m = jnp.maximum(m0, m1)
  a0, a1 = jnp.exp(m0 - m), jnp.exp(m1 - m)
  return acc0 * a0[..., None] + acc1 * a1[..., None], m, l0 * a0 + l1 * a1


def finish(state, dtype, sinks: jax.Array | None = None) -> jax.Array:
  """(acc, m, l) -> out[b,l,n,d]: normalize (every query sees at least itself); `sinks` [n]
  (this device's heads) merged first as a block of value 0 whose one logit is the sink."""
  if sinks is not None:
    acc, m, l = state
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, m.shape[1], m.shape[2], 1), m.shape)
    state = merge(state, (jnp.zeros_like(acc), sink, jnp.ones_like(l)))
  acc, _, l = state
  out = acc / jnp.maximum(l, 1e-30)[..., None]                       # [b,kv,g,l,d]
  b, kvh, g, lq, d = out.shape
  return out.transpose(0, 3, 1, 2, 4).reshape(b, lq, kvh * g, d).astype(dtype)


def _rows(state, start, stop):
  acc, m, l = state
  return acc[..., start:stop, :], m[..., start:stop], l[..., start:stop]


def _cat_rows(a, b):
  return tuple(jnp.concatenate([x, y], axis=3) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------
# The two modes, per device (inside shard_map).

def _allgather_local(q, k, v, seg, sinks=None, *, split: Split, balanced: bool, block_attention=block_attention):
  i = jax.lax.axis_index(split.axis_name)
  lq, c = q.shape[1], split.size
  q_idx = local_index(i, lq, c, balanced)
  gather = lambda x: jax.lax.all_gather(x, split.axis_name, axis=1, tiled=True)
  k_all, v_all = gather(k), gather(v)
  seg_all = None if seg is None else gather(seg)
  k_idx = jnp.concatenate([local_index(j, lq, c, balanced) for j in range(c)])
  if not balanced:
    return finish(block_attention(q, k_all, v_all, q_idx, k_idx, seg, seg_all), q.dtype, sinks)
  # Chunk i (the first local half) sees only keys before (i+1) n <= S/2: the first half
  # of every device's block, i.e. the chunks 0..C-1. Chunk 2C-1-i needs all keys.
  n = lq // 2
  first = lambda x: x.reshape((x.shape[0], c, 2, n) + x.shape[2:])[:, :, 0].reshape(
      (x.shape[0], c * n) + x.shape[2:])
  lo = block_attention(q[:, :n], first(k_all), first(v_all), q_idx[:n],
                       first(k_idx[None])[0], None if seg is None else seg[:, :n],
                       None if seg is None else first(seg_all))
  hi = block_attention(q[:, n:], k_all, v_all, q_idx[n:], k_idx,
                       None if seg is None else seg[:, n:], seg_all)
  return jnp.concatenate([finish(lo, q.dtype, sinks), finish(hi, q.dtype, sinks)], axis=1)


def _ring_local(q, k, v, seg, sinks=None, *, split: Split, balanced: bool, block_attention=block_attention):
  i = jax.lax.axis_index(split.axis_name)
  lq, c = q.shape[1], split.size
  n = lq // 2
  q_idx = local_index(i, lq, c, balanced)
  perm = [(j, (j + 1) % c) for j in range(c)]
  sl = lambda x, a, b: None if x is None else x[:, a:b]

  def own(state, kv):
    k_b, v_b, s_b = kv
    return merge(state, block_attention(q, k_b, v_b, q_idx, q_idx, seg, s_b))

  def earlier_balanced(state, kv, k_idx):      # source j < i: all queries, its first-half keys
    k_b, v_b, s_b = kv
    return merge(state, block_attention(q, k_b[:, :n], v_b[:, :n], q_idx, k_idx[:n],
                                        seg, sl(s_b, 0, n)))

  def later_balanced(state, kv, k_idx):        # source j > i: second-half queries, all keys
    k_b, v_b, s_b = kv
    hi = merge(_rows(state, n, lq), block_attention(q[:, n:], k_b, v_b, q_idx[n:], k_idx,
                                                    sl(seg, n, lq), s_b))
    return _cat_rows(_rows(state, 0, n), hi)

  def earlier_contiguous(state, kv, k_idx):    # source j < i: every pair visible
    k_b, v_b, s_b = kv
    return merge(state, block_attention(q, k_b, v_b, q_idx, k_idx, seg, s_b))

  def later_contiguous(state, kv, k_idx):      # source j > i: nothing visible
    return state

  b, _, nh, _ = q.shape
  kvh, d = k.shape[2], v.shape[-1]   # v's head size may differ from q/k's (MLA)
  state = (jnp.zeros((b, kvh, nh // kvh, lq, d), jnp.float32),
           jnp.full((b, kvh, nh // kvh, lq), _NEG, jnp.float32),
           jnp.zeros((b, kvh, nh // kvh, lq), jnp.float32))
  kv = (k, v, seg)
  branches = (earlier_balanced, later_balanced) if balanced else (earlier_contiguous, later_contiguous)
  for t in range(c):
    # Issue the next block's transfer first: it does not depend on this step's compute,
    # so the scheduler can run the collective-permute under the block's einsums.
    nxt = jax.lax.ppermute(kv, split.axis_name, perm) if t < c - 1 else None
    if t == 0:
      state = _remat(own)(state, kv)
    else:
      j = (i - t) % c
      k_idx = local_index(j, lq, c, balanced)
      state = _remat(lambda st, kv, k_idx, j=j: jax.lax.cond(j < i, branches[0], branches[1], st, kv, k_idx))(
          state, kv, k_idx)
    kv = nxt
  return finish(state, q.dtype, sinks)


def _remat(step):
  """A ring step whose scores are recomputed in the backward pass: only its inputs (the
  running statistics and the K/V block) are saved, so the backward holds one block's
  scores at a time instead of all C (what that saved on a TPU slice:
  docs/results/code_notes.md)."""
  return jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)


_LOCAL = {"allgather": _allgather_local, "ring": _ring_local}


def attention(q: jax.Array, k: jax.Array, v: jax.Array,
              segment_ids: jax.Array | None = None, split: Split | None = None,
              options=None, sinks: jax.Array | None = None) -> jax.Array:
  """Causal GQA with the sequence split over the `length` mesh axes: q[b,l,n,d],
  k/v[b,l,kv,d] (global shapes) -> [b,l,n,d], equal to the single-device attention.

  Mode and layout come from the enclosing `sequence(...)` (default: 'allgather',
  natural order); `options` (layers/attention.py AttentionOptions) give the window, the
  soft-cap and the implementation: when it resolves to 'flash' (a TPU, or 'flash' asked
  for), 'allgather' runs the splash kernel per device (`_flash_allgather`); 'ring' has
  no kernel form (it needs each block's softmax statistics, which the kernel's backward
  does not take), so 'auto' keeps its einsum blocks and an explicit 'flash' is refused.
  The shard_map (sharding/manual.py) is manual over every mesh axis, each operand split as
  the rules split its logical dims (batch over data, heads over model, ...), so each device computes on
  its own rows and heads only. `sinks` [n]: attention sinks, split like q's heads (`finish`). (Manual over the `length` axes alone, the partitioner
  gathered the batch into the body on the CPU backend: every device then did the whole
  batch's attention.)"""
  split = split or length_split()
  if split is None:
    raise ContextParallelError("context_parallel.attention needs rules that split 'length' "
                               "over a mesh axis of size > 1")
  mode, balanced = _sequence.get()
  check_mode(mode)
  check_length(q.shape[1], split, balanced)
  window = getattr(options, "window", None)
  softcap = getattr(options, "softcap", None)
  layouts = _layouts(q, k, segment_ids)
  if _uses_flash(options, mode, q.shape[1] // split.size, q.shape[1]):
    if sinks is not None:
      raise ContextParallelError("model.attention='flash' with attention sinks (model.attention_sinks): "
                                 "the splash kernel has no sink logit; use model.attention='auto' or 'xla'")
    return _flash_allgather(q, k, v, segment_ids, split, balanced, options, layouts)
  q_layout, kv_layout, seg_layout = layouts
  local = functools.partial(_LOCAL[mode], split=split, balanced=balanced, block_attention=functools.partial(
      block_attention, window=window, softcap=softcap))
  seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
  args, in_layouts = (q, k, v, seg), (q_layout, kv_layout, kv_layout, seg_layout)
  if sinks is not None:
    args, in_layouts = args + (sinks,), in_layouts + (q_layout.select(2),)
  return manual.run(local, in_layouts=in_layouts, out_layouts=q_layout)(*args)


def _uses_flash(options, mode: str, local_len: int, length: int) -> bool:
  """Whether this attention runs the splash kernel (see `attention`)."""
  if options is None:
    return False
  impl = resolve(options, local_len, length)
  if impl != "flash":
    return False
  if mode == "ring":
    if options.implementation == "flash":
      raise ContextParallelError(
          "model.attention='flash' with model.context_parallel='ring': the ring merges each "
          "block's softmax statistics, which the splash kernel does not hand back through "
          "its backward pass; use model.context_parallel='allgather' (runs the kernel) or "
          "model.attention='auto' (the ring's einsum blocks)")
    return False
  return True


def natural(x: jax.Array, size: int) -> jax.Array:
  """The all-gathered sequence (axis 1) from the balanced order back to the natural one:
  device j's block is chunks (j, 2C-1-j), so chunks 0..C-1 are the first halves in device
  order and chunks C..2C-1 the second halves in reverse device order. Slices and a
  concatenation (no gather), transposed to the same in the backward pass."""
  b, s = x.shape[:2]
  n = s // (2 * size)
  x = x.reshape((b, size, 2, n) + x.shape[2:])
  flat = lambda y: y.reshape((b, size * n) + x.shape[4:])
  return jnp.concatenate([flat(x[:, :, 0]), flat(x[:, ::-1, 1])], axis=1)


def _flash_allgather(q, k, v, segment_ids, split: Split, balanced: bool, options, layouts):
  """'allgather' with the splash kernel: each device all-gathers K/V (and segment ids),
  puts them in natural order (`natural`), and runs the kernel on its own query rows.

  Masking: the kernel's `SequenceMask` (layers/flash.py) takes the real position of every
  query row (`balanced_order`, or 0..S-1 for the contiguous layout) and compares it with
  the key's natural index, so causality is exact for the load-balanced order; the
  kernel is built once for the whole sequence with `q_seq_shards = C` and its block
  tables enter the shard_map split along the rows, so each device skips the blocks fully
  masked for *its* rows (device i's chunk i needs only keys before (i+1) S/2C). Segment
  ids (q: the local ones; kv: the gathered ones) keep documents apart inside the kernel.
  Why not a per-device CausalMask `offset`: the offset is static and the device index
  is not (and the balanced rows are two non-adjacent chunks)."""
  q_layout, kv_layout, seg_layout = layouts
  local_heads = q.shape[2] // q_layout.parts(2)
  length = q.shape[1]
  order = balanced_order(length, split.size) if balanced else np.arange(length)
  kernel = flash.sequence_kernel(local_heads, order, length, split.size, window=options.window,
                                 softcap=options.softcap, block_q=options.flash_block_q,
                                 block_kv=options.flash_block_kv, interpret=options.interpret)
  # The kernel's tables are [heads, rows]: cut along the rows as q's sequence is.
  kernel_specs = kernel.manual_sharding_spec(q_layout.select(None, 1).sharding())
  gather = lambda x: jax.lax.all_gather(x, split.axis_name, axis=1, tiled=True)
  reorder = (lambda x: natural(x, split.size)) if balanced else (lambda x: x)

  def body(q, k, v, seg, kernel):
    k_all, v_all = reorder(gather(k)), reorder(gather(v))
    seg_all = None if seg is None else reorder(gather(seg))
    return flash.run_sequence_kernel(kernel, q, k_all, v_all, seg, seg_all)

  seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
  return manual.run(body, in_layouts=(q_layout, kv_layout, kv_layout, seg_layout, kernel_specs),
                    out_layouts=q_layout)(q, k, v, seg, kernel)


def _layouts(q, k, segment_ids) -> tuple[manual.Layout, manual.Layout, manual.Layout]:
  """Layouts of q, k/v and segment ids from the rules in force. Query head h uses kv head
  h // g, so a device's query heads find their kv heads locally only when both head dims
  are split alike; otherwise both stay whole inside the manual region."""
  q_layout = manual.layout(_Q_AXES, q.shape, name="context parallel q")
  kv_layout = manual.layout(("batch", "length", "kv_heads", "kv"), k.shape, name="context parallel k/v")
  seg_layout = manual.layout(("batch", "length"), q.shape[:2], name="context parallel segment ids")
  if q_layout.axes[2] != kv_layout.axes[2]:
    q_layout, kv_layout = q_layout.whole(2), kv_layout.whole(2)
  return q_layout, kv_layout, seg_layout
