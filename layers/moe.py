"""The MoE feed-forward layer: a router, E expert gated FFNs, optional shared experts, and
one of two dispatches (`cfg.dispatch`).

Letters (as in GShard and Praxis): g groups, s tokens per group, e experts,
c capacity slots per expert and group, m embed, h expert hidden, k experts per token.

'capacity' (GShard, arXiv 2006.16668; gating in `layers/routers.py: top2_gating`):

    tokens [b, l, m] -> [g, s, m]                        groups keep the 'batch' sharding
    gating(router logits [g, s, e], float32) -> combine [g, s, e, c], dispatch (0/1)
    expert_in  = einsum('gsec,gsm->egcm', dispatch, x)   'expert'-major: ALL-TO-ALL
    expert_out = FFN_e(expert_in)                         weights [e, m, h], local to e's shard
    y          = einsum('gecm,gsec->gsm', expert_out, combine)     back: ALL-TO-ALL

  The model never asks for an all-to-all. `shard(expert_in, ('expert', 'batch', None,
  'embed'))` says the expert dim is split wherever the rules put 'expert'; the tokens
  arrive split by group (their 'batch' dim). When 'expert' and 'batch' map to the same
  mesh axis (GShard: experts over the data axis), going from g-split to e-split is
  exactly an all-to-all, and the SPMD partitioner emits one; the same holds with
  experts on their own axis when the batch is split over both axes. Tokens past an
  expert's C slots are dropped (their FFN output is 0; the residual carries them).

'dropless' (`layers/routers.py: route` + `layers/moe_dispatch.py`): top-k of softmax or
  sigmoid scores, every token reaches its k experts through a grouped matmul
  (`jax.lax.ragged_dot`) over the tokens sorted by expert; under expert parallelism the
  tokens travel by (ragged) all-to-all inside `shard_map`.

Options of gpt-oss's experts (configs/moe.py): a router bias, expert biases (gate/up [e, h]
added before the activation, inside every dispatch path; down [e, m] added per chosen copy,
weighted by its gate: `down_bias`), and the clamped SwiGLU (layers/glu.py).

Shared experts (DeepSeek): one gated FFN of width num_shared_experts x d_ff that every
token goes through, added to the routed output.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.layers import glu as glu_lib
from shardax.layers import moe_dispatch, routers
from shardax.layers import quantization as quant
from shardax.layers.linear import DenseGeneral
from shardax.layers.mlp import GatedMLP, activation_fn
from shardax.layers.routers import Gating, top2_gating  # noqa: F401  (re-exported)
from shardax.sharding import shard

EGCM = ("expert", "batch", None, "embed")
EGCH = ("expert", "batch", None, "mlp")
GECM = ("batch", "expert", None, "embed")
GSEC = ("batch", None, None, None)


def _expert_init(key, shape, dtype):
  """LeCun truncated normal per expert: fan-in is the middle dim of [e, in, out]."""
  std = math.sqrt(1.0 / shape[1]) / 0.87962566103423978
  return (jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * std).astype(dtype)


class MoEFeedForward(nnx.Module):
  """x[b, l, embed] -> (y[b, l, embed], stats): routed experts (+ shared), each a gated FFN.

  `cfg` is a `configs.moe.MoEConfig`. Expert weights are [e, embed, mlp] (logical
  'expert', 'embed', 'mlp'); the router [embed, e] stays replicated (it is small and
  every token needs all of it), and so does the balance bias [e] when there is one.
  """

  def __init__(self, d_model: int, cfg, *, activation: str = "silu",
               dtype=jnp.float32, param_dtype=jnp.float32, quantization: str = "none", rngs: nnx.Rngs):
    self.cfg = cfg
    self.act = activation_fn(activation) if cfg.swiglu_limit is None else glu_lib.ClampedSwiGLU(
        cfg.swiglu_alpha, cfg.swiglu_limit)
    self.dtype = dtype
    self.quantization = quantization   # the experts' and shared experts' matmuls (not the router's)
    e, h = cfg.num_experts, cfg.d_ff
    self.router = DenseGeneral(d_model, e, in_axes=("embed",), out_axes=(None,), use_bias=cfg.router_bias,
                               dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
    self.wi_gate = nnx.Param(_expert_init(rngs.params(), (e, d_model, h), param_dtype),
                             logical_axes=("expert", "embed", "mlp"))
    self.wi_up = nnx.Param(_expert_init(rngs.params(), (e, d_model, h), param_dtype),
                           logical_axes=("expert", "embed", "mlp"))
    self.wo = nnx.Param(_expert_init(rngs.params(), (e, h, d_model), param_dtype),
                        logical_axes=("expert", "mlp", "embed"))
    bias = lambda shape, axes: nnx.Param(jnp.zeros(shape, param_dtype), logical_axes=axes) if cfg.expert_bias else None
    self.wi_gate_bias, self.wi_up_bias = bias((e, h), ("expert", "mlp")), bias((e, h), ("expert", "mlp"))
    self.wo_bias = bias((e, d_model), ("expert", "embed"))
    # float32 whatever param_dtype: steps of bias_update_rate (1e-3) must not round away.
    self.balance_bias = routers.BalanceBias(jnp.zeros((e,), jnp.float32), logical_axes=(None,)
                                            ) if cfg.bias_update_rate else None
    self.shared = GatedMLP(d_model, cfg.num_shared_experts * h, activation=activation, dtype=dtype,
                           param_dtype=param_dtype, quantization=quantization,
                           rngs=rngs) if cfg.num_shared_experts else None

  def groups(self, x: jax.Array) -> jax.Array:
    """[b, l, m] -> [g, s, m] with s = cfg.group_size (None: l), g = b * l / s."""
    b, l, m = x.shape
    s = self.cfg.group_size or l
    if (b * l) % s:
      raise ValueError(f"model.moe.group_size={s} does not divide the {b} x {l} = {b * l} tokens "
                       f"of the batch; pick a divisor or a multiple of data.seq_len={l}")
    return shard(x.reshape(b * l // s, s, m), ("batch", None, "embed"))

  def __call__(self, x: jax.Array, key: jax.Array | None = None,
               deterministic: bool = False) -> tuple[jax.Array, dict]:
    """`deterministic` (evaluation): the capacity path sends every token to both of its
    top-2 experts (policy 'all'), whatever `cfg.second_expert` draws in training.

    stats: scalars (aux_loss, z_loss, max_load, ...; 'routed_copies_count' and
    'dropped_copies_count': the token copies sent to experts and those that got no expert
    output, past capacity or past a dropless buffer with expert_overflow='drop') and, with
    bias balancing, 'next_bias' [e]: the bias the train step writes back (`routers.next_bias`)."""
    if self.cfg.dispatch == "dropless":
      y, stats = self.dropless(x)
    else:
      y, stats = self.capacity(x, key, deterministic)
    if self.shared is not None:
      y = y + self.shared(x)
    return y, stats

  def dropless(self, x: jax.Array) -> tuple[jax.Array, dict]:
    cfg, dt = self.cfg, self.dtype
    logits = self.router(x, out_dtype=jnp.float32)                      # [b, l, e] float32
    bias = None if self.balance_bias is None else self.balance_bias[...]
    r = routers.route(logits, top_k=cfg.top_k, score=cfg.score, renormalize=cfg.renormalize,
                      gate_scale=cfg.gate_scale, bias=bias, n_group=cfg.n_group, topk_group=cfg.topk_group)
    params = (self.wi_gate, self.wi_up, self.wo) + (
        () if self.wi_gate_bias is None else (self.wi_gate_bias, self.wi_up_bias))
    weights = tuple(w[...].astype(dt) for w in params)
    gates = r.gates
    if cfg.gate_input:   # Llama 4: FFN(gate * x) of the one chosen expert, summed unweighted
      x, gates = x * r.gates.astype(x.dtype), jnp.ones_like(r.gates)
    y, overflow = moe_dispatch.dropless(x.astype(dt), r.index, gates, weights, self.act,
                                        buffer=cfg.expert_buffer, exchange=cfg.expert_exchange,
                                        impl=cfg.grouped_matmul, quantization=self.quantization,
                                        overflow=cfg.expert_overflow, chunks=cfg.dispatch_chunks,
                                        fp8_dispatch=cfg.fp8_dispatch)
    if self.wo_bias is not None:
      y = y + self.down_bias(r.index, gates)
    stats = {"aux_loss": r.aux_loss, "z_loss": r.z_loss, **r.metrics,
             "routed_copies_count": jnp.float32(r.index.size)}
    if cfg.expert_overflow == "drop":   # counted (the loop sums and reports them), not raised on
      stats["dropped_copies_count"] = overflow.astype(jnp.float32)
    else:
      stats["dropped_copies_count"] = jnp.float32(0.0)
      stats["expert_buffer_overflow"] = overflow.astype(jnp.float32)
    if bias is not None:
      stats["next_bias"] = routers.next_bias(bias, r.load, cfg.bias_update_rate)
    if cfg.aux_loss_pooling == "over_layers":   # the LM pools them over its MoE layers
      stats.update(expert_load=r.load, expert_prob=r.prob)
    return shard(y, ("batch", "length", "embed")), stats

  def capacity(self, x: jax.Array, key: jax.Array | None, deterministic: bool
               ) -> tuple[jax.Array, dict]:
    cfg, dt = self.cfg, self.dtype
    xg = self.groups(x)
    logits = self.router(xg, out_dtype=jnp.float32)                     # [g, s, e] float32
    if key is None:
      key = jax.random.key(cfg.seed)
    policy = "all" if deterministic else cfg.second_expert
    gating = top2_gating(logits, cfg.capacity(xg.shape[1]), policy, key, cfg.n_group, cfg.topk_group)
    dispatch = shard(gating.dispatch.astype(dt), GSEC)
    combine = shard(gating.combine.astype(dt), GSEC)

    c, n = dispatch.shape[-1], cfg.dispatch_chunks
    if c % n:
      raise ValueError(f"model.moe.dispatch_chunks={n} must divide the capacity C={c} "
                       f"(model.moe.capacity_factor, min_capacity, group_size)")
    # Piece j takes slots [j C/n, (j+1) C/n) of every expert: its own all-to-alls and FFN,
    # independent of the other pieces (the FFN works row by row), so they can overlap.
    y = sum(self._slots(xg, dispatch[..., j * c // n:(j + 1) * c // n],
                        combine[..., j * c // n:(j + 1) * c // n]) for j in range(n))
    if self.wo_bias is not None:   # each kept copy's down bias, by its gate (dropped: 0)
      y = y + jnp.einsum("gsec,em->gsm", combine, self.wo_bias[...].astype(dt))
    y = shard(y, ("batch", None, "embed"))
    stats = {"aux_loss": gating.aux_loss, "z_loss": gating.z_loss, **gating.metrics}
    return y.reshape(x.shape), stats

  def down_bias(self, index: jax.Array, gates: jax.Array) -> jax.Array:
    """[b, l, m]: sum_j gates[.., j] * wo_bias[index[.., j]], the chosen experts' down biases."""
    rows = self.wo_bias[...].astype(self.dtype)[index]                      # [b, l, k, m]
    return jnp.einsum("blkm,blk->blm", rows, gates.astype(self.dtype))

  def _slots(self, xg: jax.Array, dispatch: jax.Array, combine: jax.Array) -> jax.Array:
    """The experts' output [g, s, m] for the capacity slots `dispatch`/`combine` [g, s, e, c']."""
    dt = self.dtype
    expert_in = shard(jnp.einsum("gsec,gsm->egcm", dispatch, xg.astype(dt)), EGCM)
    ein = functools.partial(quant.einsum, self.quantization)
    gate = ein("egcm,emh->egch", expert_in, self.wi_gate[...].astype(dt))
    up = ein("egcm,emh->egch", expert_in, self.wi_up[...].astype(dt))
    if self.wi_gate_bias is not None:
      gate = gate + self.wi_gate_bias[...].astype(dt)[:, None, None, :]
      up = up + self.wi_up_bias[...].astype(dt)[:, None, None, :]
    hidden = shard(glu_lib.gated(self.act)(gate, up), EGCH)
    expert_out = shard(ein("egch,ehm->egcm", hidden, self.wo[...].astype(dt)), EGCM)
    expert_out = shard(jnp.swapaxes(expert_out, 0, 1), GECM)            # [g, e, c, m]
    return shard(jnp.einsum("gecm,gsec->gsm", expert_out, combine), ("batch", None, "embed"))
