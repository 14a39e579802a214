"""Dropless MoE dispatch: tokens sorted by expert, a grouped matmul, no capacity, no drops.

One device (or no expert parallelism), for T tokens each routed to k experts:

    flat   = index.reshape(T*k)                  the T*k (token, expert) assignments
    order  = argsort(flat)                       assignments grouped by expert
    xs     = x[order // k]                       [T*k, m] token copies, expert-major
    sizes  = bincount(flat, E)                   rows per expert
    out    = ragged_dot(act(ragged_dot(xs, Wg, sizes)) * ragged_dot(xs, Wu, sizes), Wo, sizes)
    y[t]   = sum_j gates[t, j] * out[position of assignment (t, j)]

`jax.lax.ragged_dot` multiplies each contiguous row group by its expert's matrix (the
grouped matmul of MegaBlocks / megablox), and it differentiates: the gradient of the
weights is a ragged_dot_general with the group dim on the contraction. XLA:CPU runs it
as a dense matmul per group, so on CPU (`grouped_matmul='auto'`) the rows go through
`tiled_grouped_ffn` instead: the same product as batched matmuls over one-expert tiles.

The layer runs in a manual region (sharding/manual.py: `shard_map` over the whole mesh,
cut as the rules cut each logical dim) whenever there is one: each device takes its own tokens, split over the mesh axes the rules give 'batch' and
'length' (context parallelism splits the sequence like every other per-token op; no
device sees the whole sequence), and runs the FFN of those tokens only.

Expert parallelism (the rules map logical 'expert' to mesh axes X, which must be among
the token axes): each device holds E/|X| experts. The assignments travel to the
device that holds their expert and back:
- `ragged_all_to_all` (TPU, GPU: `exchange='ragged'`): every device sends exactly its
  rows per destination into a receive buffer of `expert_buffer x k x T` rows;
- padded `all_to_all` (`exchange='padded'`, any backend, the one XLA:CPU runs): a fixed
  slot block of `ceil(expert_buffer x k x T / |X|)` rows per destination.
`expert_buffer=None` (the default) sizes both at the no-overflow bound: a device sends
one shard at most min(k, E/|X|) copies of each of its T tokens (a token picks an expert
at most once), so |X| x min(k, E/|X|) / k fair shares hold any routing. That is the
default rather than a smaller bound with drops counted in a metric: 'dropless' then
means dropless (the sharded step equals the one-device step for every router state,
including the collapsed routers of early training, which overflowed 2x at step 1), and
its memory is a real array the dry run measures. A smaller `expert_buffer` trades that
guarantee for memory. With `expert_overflow='drop'` the copies past the buffer are left
out (no expert output for them, as capacity dispatch drops) and their fraction is logged;
with 'error' (the default)
a step where some device would need more room than its buffer is not applied: its output
turns NaN (the step's finite guard keeps the old weights) and the count reaches the
metrics as `moe/expert_buffer_overflow`, on which the training loop raises an error
naming `model.moe.expert_buffer`. (A host callback raising inside the SPMD program
would leave the other devices waiting in the next all-to-all.) Weights split over
'mlp' (tensor parallel) stay split: the partial outputs are summed over those axes.
Weights split over 'embed' (FSDP) enter split and are all-gathered inside, like a dense
layer's: their gradients leave by reduce-scatter, not an all-reduce of every weight (the
TPU compiler may still lower that reduce-scatter as all-reduce + slice:
docs/results/moe_pods.md).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from shardax.layers import glu as glu_lib
from shardax.layers import quantization as quant
from shardax.pipeline import in_stage_body
from shardax.sharding import manual
from shardax.sharding.target import target_platform

EXCHANGES = ("auto", "ragged", "padded")
# The name of each expert matmul's output (gate, up, down), which the remat policy
# 'moe_matmuls' (layers/blocks.py) saves: megablox's kernels are Pallas calls, not dots,
# so 'dots' recomputes them.
EXPERT_MATMUL = "expert_matmul"
# The down projection's output and the expert outputs back on the token side (after the
# return exchange), named apart so a policy can keep the second without the first: with
# fine-grained experts the down outputs fill a padded receive buffer (DeepSeek-V3: 940 MB
# a layer per chip), the returned ones only the real copies (470 MB), and keeping them
# spares the backward the return exchange and the down matmul ('moe_returned').
EXPERT_DOWN = "expert_down"
EXPERT_RETURNED = "expert_returned"
IMPLS = ("auto", "ragged_dot", "tiled", "megablox")
FP8, FP8_MAX = jnp.float8_e4m3fn, 448.0


def _count(ids: jax.Array, n: int) -> jax.Array:
  """int32 [n]: how many of `ids` equal each of 0..n-1 (ids >= n are not counted)."""
  return jnp.zeros((n,), jnp.int32).at[ids].add(1, mode="drop")


@jax.custom_vjp
def permute(v: jax.Array, p: jax.Array, inverse: jax.Array) -> jax.Array:
  """v[p]: v's rows reordered by the permutation p (every row of v used once), given
  `inverse` = argsort(p). The backward gathers too: the transpose of v -> v[p] is
  ct -> ct[inverse]. So both ways are one row gather, where autodiff of a gather writes a
  scatter-add, and the scatter form `zeros.at[inverse].set(v)` (the same rows) is a
  scatter forward plus a scatter of update ids for its JVP, each as large as v."""
  return v[p]


permute.defvjp(lambda v, p, inverse: (v[p], inverse),
               lambda inverse, ct: (ct[inverse], None, None))   # the permutations: no cotangent


def grouped_ffn(xs: jax.Array, sizes: jax.Array, w_gate, w_up, wo, act: Callable,
                impl: str = "ragged_dot", quantization: str = "none", bias: tuple | None = None) -> jax.Array:
  """The gated FFN of each expert on its contiguous rows of xs [R, m] (group g: the sizes[g]
  rows after the groups before it); rows past sum(sizes) belong to no expert and come out 0.
  `act`: a unary activation (act(gate) * up) or a layers/glu.py ClampedSwiGLU. `bias`: (b_gate,
  b_up) [E, h], each expert's gate/up biases added to its rows before the activation (gpt-oss),
  or None. `quantization`: the three matmuls in 8 bits (layers/quantization.py)."""
  if impl == "tiled":
    return tiled_grouped_ffn(xs, sizes, w_gate, w_up, wo, act, quantization=quantization, bias=bias)
  if impl == "megablox":
    return megablox_ffn(xs, sizes, w_gate, w_up, wo, act, bias=bias)
  rd = lambda a, w, name=EXPERT_MATMUL: checkpoint_name(quant.ragged_dot(quantization, a, w, sizes), name)
  b_gate, b_up = _row_bias(bias, sizes, xs.shape[0], xs.dtype)
  hidden = glu_lib.gated(act)(_plus(rd(xs, w_gate), b_gate), _plus(rd(xs, w_up), b_up))
  return rd(hidden.astype(xs.dtype), wo, EXPERT_DOWN)


def _row_bias(bias: tuple | None, sizes: jax.Array, rows: int, dtype) -> tuple:
  """(b_gate, b_up) of each of `rows` rows sorted by expert ([rows, h]), or (None, None)."""
  if bias is None:
    return None, None
  e = glu_lib.row_experts(sizes, rows)
  return tuple(b[e].astype(dtype) for b in bias)


def _plus(x: jax.Array, bias: jax.Array | None) -> jax.Array:
  """x + bias, or x itself without one (no added zeros: the unbiased FFN stays bit for bit)."""
  return x if bias is None else x + bias


def megablox_ffn(xs, sizes, w_gate, w_up, wo, act: Callable, tile: int = 128, bias: tuple | None = None) -> jax.Array:
  """`grouped_ffn` with megablox's Pallas kernels (MaxText's sparse matmul): gmm forward and
  for the input gradient, tgmm for the weight gradient. Both visit only the row tiles that
  hold a group's rows (a dynamic grid), where XLA's TPU lowering of ragged_dot's weight
  gradient is a dense masked matmul over every group x every row (E x the work with all
  experts local). Rows are padded to whole tiles; rows past sum(sizes) come out 0. CPU runs
  the kernels in Pallas' interpreter (slow: tests only)."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm
  r, m = xs.shape
  rows = -(-r // tile) * tile
  valid = (jnp.arange(rows) < jnp.sum(sizes))[:, None]
  # The kernels leave rows outside every group unwritten, forward and backward: each input
  # and output goes through a select, so neither values nor gradients of those rows leak.
  keep = lambda v: jnp.where(valid, v, 0)
  platform = target_platform()
  if platform not in ("tpu", "cpu"):   # a Mosaic TPU kernel: no GPU lowering
    raise ValueError(f"model.moe.grouped_matmul='megablox' runs on TPUs (and CPUs, interpreted), "
                     f"not on {platform}; use 'auto' (jax.lax.ragged_dot there)")
  interpret = platform == "cpu"
  mm = lambda a, w, name=EXPERT_MATMUL: checkpoint_name(keep(gmm(
      a, w, sizes, preferred_element_type=xs.dtype,
      tiling=(tile, min(tile * 4, a.shape[1]), min(tile * 4, w.shape[2])), interpret=interpret)),
      name)
  x = keep(jnp.pad(xs, ((0, rows - r), (0, 0))))
  b_gate, b_up = _row_bias(bias, sizes, rows, xs.dtype)
  hidden = keep(glu_lib.gated(act)(_plus(mm(x, w_gate), b_gate), _plus(mm(x, w_up), b_up)).astype(xs.dtype))
  return mm(hidden, wo, EXPERT_DOWN)[:r]


def tiled_grouped_ffn(xs, sizes, w_gate, w_up, wo, act: Callable, tile: int = 128,
                      quantization: str = "none", bias: tuple | None = None) -> jax.Array:
  """`grouped_ffn` as batched matmuls over row tiles that each belong to one expert.

  XLA:CPU runs ragged_dot as one dense matmul per group over all rows (E times the work,
  measured 8.3x at E=8 and 44x at E=32); here each group is padded to whole tiles of
  `tile` rows (at most E x (tile - 1) padding rows in all), each tile takes its expert's
  weights, and one einsum does every tile: the same result, about R x m x h work."""
  r, m = xs.shape
  e = w_gate.shape[0]
  n = -(-r // tile) + e                                       # enough tiles for any sizes
  padded = -(-sizes // tile) * tile
  ends, pends = jnp.cumsum(sizes), jnp.cumsum(padded)
  row = jnp.arange(r, dtype=jnp.int32)
  group = jnp.searchsorted(ends, row, side="right")          # e for rows past every group
  valid = group < e
  g = jnp.minimum(group, e - 1)
  dst = jnp.where(valid, (pends - padded)[g] + row - (ends - sizes)[g], n * tile)
  tiles = jnp.zeros((n * tile, m), xs.dtype).at[dst].set(xs, mode="drop").reshape(n, tile, m)
  expert = jnp.minimum(jnp.searchsorted(pends, jnp.arange(n) * tile, side="right"), e - 1)
  ein = lambda spec, a, w, name=EXPERT_MATMUL: checkpoint_name(quant.einsum(quantization, spec, a, w), name)
  b_gate, b_up = (None, None) if bias is None else (b[expert][:, None, :].astype(xs.dtype) for b in bias)
  hidden = glu_lib.gated(act)(_plus(ein("ntm,nmh->nth", tiles, w_gate[expert]), b_gate),
                              _plus(ein("ntm,nmh->nth", tiles, w_up[expert]), b_up))
  out = ein("nth,nhm->ntm", hidden.astype(xs.dtype), wo[expert], EXPERT_DOWN).reshape(n * tile, -1)
  return jnp.where(valid[:, None], out[jnp.minimum(dst, n * tile - 1)], 0)


def dropless_local(x: jax.Array, index: jax.Array, gates: jax.Array, weights: tuple,
                   act: Callable, impl: str = "ragged_dot", quantization: str = "none") -> jax.Array:
  """y [T, m] = sum_j gates[t, j] * FFN_{index[t, j]}(x[t]) for x [T, m], index/gates [T, k];
  `weights`: (w_gate, w_up, wo), or with the gate/up biases (..., b_gate, b_up)."""
  t, k = index.shape
  e = weights[0].shape[0]
  flat = index.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.argsort(order)
  out = grouped_ffn(x[order // k], _count(flat, e), *weights[:3], act, impl, quantization, weights[3:] or None)
  out = permute(out, inverse, order)                                 # back to (token, choice)
  return jnp.einsum("tkm,tk->tm", out.reshape(t, k, -1), gates.astype(out.dtype))


def _exchange_padded(rows, ids, dest, n: int, per_dest: int, axes):
  """Send row r to device dest[r] (rows sorted by dest) in fixed blocks of `per_dest` slots.
  Returns (send, back, route, received ids (pad: -1), overflow count): send(v, route) takes
  rows-shaped values [a, ...] to the receive layout [n*per_dest, ...], back(v, route) takes
  that layout back into the original order (send's transpose); `route`, the routing arrays
  they use, is an argument, not a closure, so a custom_vjp backward may take it."""
  a = rows.shape[0]
  counts = _count(dest, n)
  rank = jnp.arange(a, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest]
  ok = rank < per_dest
  slot = jnp.where(ok, dest * per_dest + rank, n * per_dest)           # out of range: not sent
  a2a = lambda v: jax.lax.all_to_all(v, axes, 0, 0, tiled=True)   # block d goes to device d

  def send(v, route, fill=0):
    # Each kept row has its own slot (the rest, out of range, are dropped): unique indices,
    # which also makes the scatter transposable where a rule differentiates `send` itself.
    return a2a(jnp.full((n * per_dest,) + v.shape[1:], fill, v.dtype).at[route[0]].set(
        v, mode="drop", unique_indices=True))

  def back(out, route):
    slot, ok = route
    return jnp.where(ok[:, None], a2a(out)[jnp.minimum(slot, n * per_dest - 1)], 0)
  route = (slot, ok)
  return send, back, route, send(ids, route, -1), jnp.sum(~ok)


def _exchange_ragged(rows, ids, dest, n: int, capacity: int, axes):
  """As `_exchange_padded`, with `ragged_all_to_all`: exactly the rows each destination
  gets, packed into a receive buffer of `capacity` rows."""
  a = rows.shape[0]
  counts = _count(dest, n)                                            # [n] rows I send to each
  starts = jnp.cumsum(counts) - counts
  matrix = jax.lax.all_gather(counts, axes, tiled=False)              # [n senders, n receivers]
  me = jax.lax.axis_index(axes)
  before = jnp.cumsum(matrix, axis=0) - matrix                        # rows earlier senders put there
  out_offsets = before[me]                                            # where my block lands in each
  recv_sizes = matrix[:, me]
  recv_starts = before[:, me]
  overflow = jnp.maximum(jnp.sum(recv_sizes) - capacity, 0)
  # Room for my block in each receiver (what does not fit is cut, and reported above).
  send_sizes = jnp.clip(capacity - out_offsets, 0, counts)
  recv_sizes_fit = jnp.clip(capacity - recv_starts, 0, recv_sizes)
  # Back: each receiver returns its block from sender s to s's original offsets.
  back_offsets = jax.lax.all_to_all(starts, axes, 0, 0, tiled=True)  # [s]: s's starts[me]

  def go(v, rows_out, in_off, sizes, out_off, rsizes):
    buf = jnp.zeros((rows_out,) + v.shape[1:], v.dtype)
    return jax.lax.ragged_all_to_all(v, buf, in_off, sizes, out_off, rsizes, axis_name=axes)

  def send(v, route):
    starts, send_sizes, out_offsets, recv_sizes_fit, _, _ = route
    return go(v, capacity, starts, send_sizes, out_offsets, recv_sizes_fit)

  def back(out, route):
    _, send_sizes, _, recv_sizes_fit, recv_starts, back_offsets = route
    return go(out, a, recv_starts, recv_sizes_fit, back_offsets, send_sizes)
  route = (starts, send_sizes, out_offsets, recv_sizes_fit, recv_starts, back_offsets)
  received = jnp.arange(capacity) < jnp.sum(recv_sizes_fit)
  return send, back, route, jnp.where(received, send(ids, route), -1), overflow


def _fp8_sent(v: jax.Array, send: Callable, block: int = 128) -> jax.Array:
  """send(v) [a, m] -> [r, m], v travelling in fp8: e4m3 with a power-of-two scale per row and
  `block` columns (DeepSeek-V3's 1 x 128 tiles), the scales beside it in f32 (4 bytes per
  128): ~0.53 of the bf16 bytes. Returns what arrives, dequantized, in v's dtype."""
  a, m = v.shape
  b = block if m % block == 0 else m
  blocks = v.reshape(a, m // b, b).astype(jnp.float32)
  amax = jnp.max(jnp.abs(blocks), axis=-1)
  # A power of two (exact to divide and multiply by) taking the block's max to <= 448.
  scale = jnp.exp2(jnp.ceil(jnp.log2(jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / FP8_MAX)))
  q = (blocks / scale[..., None]).astype(FP8).reshape(a, m)
  got, scale = send(q), send(scale)
  return (got.astype(jnp.float32).reshape(-1, m // b, b) * scale[..., None]).reshape(-1, m).astype(v.dtype)


def _fp8_send(rows: jax.Array, send: Callable) -> jax.Array:
  """send(rows) with the rows in fp8 (`_fp8_sent`). The backward sends the cotangent back by
  the transpose of `send` (the return exchange) in rows' dtype, straight through the rounding:
  the gradient the unquantized exchange would give at the rounded rows."""
  go = jax.custom_jvp(lambda r: _fp8_sent(r, send))
  # The tangent rule is the unquantized exchange (linear), so reverse mode transposes it into
  # the return exchange of the cotangent.
  go.defjvp(lambda primals, tangents: (go(*primals), send(*tangents)))
  return go(rows)


def _return_fp8_gradient(out: jax.Array, send: Callable, back: Callable, route) -> jax.Array:
  """back(out, route), the return exchange, in out's dtype; its transpose, the expert outputs'
  gradient on its way to the experts, travels in fp8 (`_fp8_sent` through `send`), as
  DeepSeek-V3 sends the activation gradient before the down projection."""
  @jax.custom_vjp
  def go(o, route):
    return back(o, route)

  def bwd(route, ct):
    return _fp8_sent(ct, lambda v: send(v, route)), None   # the routing arrays: no cotangent

  go.defvjp(lambda o, route: (go(o, route), route), bwd)
  return go(out, route)


def dropless_expert_parallel(x, index, gates, weights, act, *, axes, n: int, num_experts: int,
                             buffer: float | None, exchange: str, impl: str, quantization: str = "none",
                             fp8_dispatch: bool = False):
  """Per device (inside shard_map over `axes`, n devices): x [T, m] local tokens, index and
  gates [T, k]; weights hold the E/n local experts. `buffer`: see the module docstring.
  `fp8_dispatch`: what travels to the experts goes in fp8: the rows (`_fp8_send`) and, in the
  backward, the expert outputs' gradient (`_return_fp8_gradient`); the outputs and the rows'
  gradient come back in x's dtype."""
  t, k = index.shape
  local = num_experts // n
  flat = index.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.argsort(order)
  expert = flat[order]
  rows = x[order // k]
  # Rows per destination: buffer x the fair share t*k/n, or (None) the most one device can
  # send one shard, t x min(k, local experts): no routing overflows it.
  per_dest = t * min(k, local) if buffer is None else max(1, math.ceil(buffer * t * k / n))
  if exchange == "ragged":
    capacity = n * per_dest if buffer is None else max(1, math.ceil(buffer * t * k))
    send, back, route, ids, overflow = _exchange_ragged(rows, expert % local, expert // local, n,
                                                        capacity, axes)
  else:
    send, back, route, ids, overflow = _exchange_padded(rows, expert % local, expert // local, n,
                                                        per_dest, axes)
  to_experts = lambda v: send(v, route)
  recv = _fp8_send(rows, to_experts) if fp8_dispatch else to_experts(rows)
  ids = jnp.where(ids < 0, local, ids)                                # padding sorts last
  order2 = jnp.argsort(ids, stable=True)                               # a permutation of all received rows
  inverse2 = jnp.argsort(order2)
  out = grouped_ffn(permute(recv, order2, inverse2), _count(ids, local), *weights[:3], act, impl,
                    quantization, weights[3:] or None)
  out = permute(out, inverse2, order2)                                # padding rows: 0 from grouped_ffn
  out = checkpoint_name(_return_fp8_gradient(out, send, back, route) if fp8_dispatch else back(out, route),
                        EXPERT_RETURNED)
  out = permute(out, inverse, order)
  y = jnp.einsum("tkm,tk->tm", out.reshape(t, k, -1), gates.astype(out.dtype))
  return y, overflow


def resolve_exchange(exchange: str) -> str:
  """'auto': ragged_all_to_all where the backend runs it (TPU, GPU), else padded blocks."""
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange={exchange!r}: use one of {EXCHANGES}")
  if exchange != "auto":
    return exchange
  return "padded" if target_platform() == "cpu" else "ragged"


def resolve_impl(impl: str, quantization: str = "none") -> str:
  """'auto': jax.lax.ragged_dot (a grouped-matmul kernel on TPU and GPU), 'tiled' on CPU;
  in a pipeline stage on a TPU, megablox. The stage body is vmapped over the stages, which
  gives every ragged_dot a batch dim, and the TPU compiler refuses that ("number of batch
  dimensions should be 0"); megablox's Pallas kernels take it as one more grid dim."""
  if impl not in IMPLS:
    raise ValueError(f"grouped matmul {impl!r}: use one of {IMPLS}")
  platform = target_platform()
  if platform == "tpu" and in_stage_body():
    if impl in ("auto", "ragged_dot") and quantization != "none":
      raise ValueError(f"model.moe.grouped_matmul={impl!r} with model.quantization={quantization!r} "
                       f"in a pipeline stage on a TPU: the TPU compiler refuses the stage body's "
                       f"batched ragged_dot and megablox has no 8-bit path; use "
                       f"model.quantization='none' or no pipeline")
    if impl == "ragged_dot":
      raise ValueError("model.moe.grouped_matmul='ragged_dot' in a pipeline stage on a TPU: the "
                       "stage body is vmapped and the TPU compiler refuses a ragged_dot with a batch "
                       "dim; use 'megablox' (or 'auto', which picks it there)")
    if impl == "auto":
      return "megablox"
  if impl != "auto":
    return impl
  return "tiled" if platform == "cpu" else "ragged_dot"


def dropless(x: jax.Array, index: jax.Array, gates: jax.Array, weights: tuple, act: Callable,
             *, buffer: float | None = None, exchange: str = "auto", impl: str = "auto",
             quantization: str = "none", overflow: str = "error", chunks: int = 1,
             fp8_dispatch: bool = False) -> tuple[jax.Array, jax.Array]:
  """(y [b, l, m], overflow count): the dropless MoE FFN of x [b, l, m] routed by index/gates
  [b, l, k]; weights (w_gate [E, m, h], w_up [E, m, h], wo [E, h, m]) sharded by the rules,
  optionally followed by the gate/up biases (b_gate, b_up [E, h], split like the weights' e and h).
  `overflow`: 'error' poisons y when copies did not fit (below), 'drop' leaves them out (their
  rows never travel: 0 from the experts). `chunks`: each device's tokens in that many pieces,
  each exchanged and multiplied on its own (the exchange of one can run under another's
  expert matmuls); per token the same result. `fp8_dispatch`: under expert parallelism what
  travels to the experts goes in fp8 (`dropless_expert_parallel`)."""
  b, l, m = x.shape
  e = weights[0].shape[0]
  impl = resolve_impl(impl, quantization)
  if not manual.active():
    y = dropless_local(x.reshape(b * l, m), index.reshape(b * l, -1),
                       gates.reshape(b * l, -1), weights, act, impl, quantization)
    return y.reshape(x.shape), jnp.zeros((), jnp.int32)
  lead, weight_dims = ("batch", "length"), ("expert", "embed", "mlp")
  tokens = manual.layout(lead + (None,), x.shape, name=f"MoE {lead}")   # x, index and gates alike
  batch, length = tokens.axes[:2]
  token_axes = batch + length                          # every device: its own tokens only
  w_in = manual.layout(weight_dims, weights[0].shape, name=f"MoE {weight_dims}")
  if m % w_in.parts(1):
    w_in = w_in.whole(1)       # an uneven split (sharding.allow_uneven): the weights enter whole
  w_out, b_in = w_in.select(0, 2, 1), w_in.select(0, 2)   # wo [E, h, m]; biases [E, h]
  expert, embed, mlp = w_in.axes
  if not set(expert) <= set(token_axes):
    raise ValueError(
        f"dropless MoE dispatch under expert parallelism needs the tokens split over the expert "
        f"mesh axes {expert} (the rules split 'batch' over {batch}, 'length' over {length}); "
        f"use a preset like 'expert' or 'expert_axis', or model.moe.dispatch='capacity'")
  mode = resolve_exchange(exchange)

  def body(x, index, gates, w_gate, w_up, wo, *bias):
    if embed:
      # FSDP: the weights enter split over the embed axes and are gathered here, as a dense
      # layer's are; the transpose of this gather is a reduce-scatter of their gradients.
      # (Entering whole, their gradients would be summed by an all-reduce of every weight.)
      # One mesh axis at a time, the minor one first (so the blocks land in the tiled
      # order): libtpu writes one all-gather over a group spanning a 3D torus (v5p's 128
      # chips) as an all-reduce of the whole weight, and its transpose too, but per axis
      # a true all-gather and reduce-scatter (docs/results/moe_pods.md).
      gather = lambda w, dim: functools.reduce(
          lambda w, a: jax.lax.all_gather(w, a, axis=dim, tiled=True), reversed(embed), w)
      w_gate, w_up, wo = gather(w_gate, 1), gather(w_up, 1), gather(wo, 2)
    bl, ll = x.shape[:2]
    args = (x.reshape(bl * ll, m), index.reshape(bl * ll, -1), gates.reshape(bl * ll, -1))
    if expert:
      t = bl * ll
      if t % chunks:
        raise ValueError(f"model.moe.dispatch_chunks={chunks} must divide each device's {t} tokens")
      pieces = [dropless_expert_parallel(*(a[j * t // chunks:(j + 1) * t // chunks] for a in args),
                                         (w_gate, w_up, wo, *bias), act, axes=expert,
                                         n=w_in.parts(0), num_experts=e,
                                         buffer=buffer, exchange=mode, impl=impl, quantization=quantization,
                                         fp8_dispatch=fp8_dispatch)
                for j in range(chunks)]
      y = jnp.concatenate([p[0] for p in pieces]) if chunks > 1 else pieces[0][0]
      overflow = jax.lax.psum(sum(p[1] for p in pieces), token_axes)
    else:
      y, overflow = dropless_local(*args, (w_gate, w_up, wo, *bias), act, impl, quantization), jnp.zeros((), jnp.int32)
    if mlp:
      y = jax.lax.psum(y, mlp)
    return y.reshape(bl, ll, m), overflow

  y, count = manual.run(body, in_layouts=(tokens,) * 3 + (w_in, w_in, w_out) + (b_in,) * len(weights[3:]),
                        out_layouts=(tokens, manual.Layout(())))(x, index, gates, *weights)
  if overflow == "error":
    # Never a silent drop: the output (so the loss and the step) becomes NaN, which keeps the
    # update out of the weights, and the count reaches the metrics, where the loop raises.
    y = jnp.where(count > 0, jnp.nan, y)
  return y, count
