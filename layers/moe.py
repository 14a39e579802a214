"""GShard mixture of experts: top-2 gating, dispatch/combine einsums, expert FFN.

Letters (as in GShard and Praxis): g groups, s tokens per group, e experts,
c capacity slots per expert and group, m embed, h expert hidden.

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
experts on their own axis when the batch is split over both axes.

Gating (GShard, arXiv 2006.16668, Algorithm 1), per group of S tokens:
  gates = softmax(logits); expert 1 = argmax; expert 2 = argmax of the rest
  ('all'), kept with probability 2 * g2 / (g1 + g2) ('random'), or drawn from the
  softmax of the other logits ('sampling'); g1, g2 normalized to sum to 1.
  Slots: a token's position in an expert is the count of earlier tokens of the group
  sent there (a cumsum over s); all first choices queue before all second choices;
  positions >= C are dropped (the token's FFN output is then 0; the residual remains).
  Balance loss: E^2 * mean_e(me * ce), me = mean gate of e, ce = fraction of tokens
  whose first choice is e (before capacity); 1.0 when perfectly uniform.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.layers.linear import DenseGeneral
from shardax.layers.mlp import activation_fn
from shardax.sharding import shard

EGCM = ("expert", "batch", None, "embed")
EGCH = ("expert", "batch", None, "mlp")
GECM = ("batch", "expert", None, "embed")
GSEC = ("batch", None, None, None)


class Gating(NamedTuple):
  """Output of `top2_gating` for logits [g, s, e] and capacity c."""
  combine: jax.Array    # float32 [g, s, e, c]: gate weight of token s in slot c of expert e
  dispatch: jax.Array   # bool [g, s, e, c]: token s occupies slot c of expert e
  index: jax.Array      # int32 [g, s, 2]: first and second choice (before capacity)
  kept: jax.Array       # bool [g, s, 2]: whether each choice got a slot
  aux_loss: jax.Array   # scalar balance loss, E^2 * mean(me * ce)
  z_loss: jax.Array     # scalar mean(logsumexp(logits)^2)
  metrics: dict         # scalar diagnostics (see `top2_gating`)


def top2_gating(logits: jax.Array, capacity: int, second_expert: str = "all",
                key: jax.Array | None = None) -> Gating:
  """GShard top-2 gating of router logits [g, s, e] with `capacity` slots per expert.

  metrics: 'dropped_fraction' (tokens that reach no expert), 'top1_overflow' (tokens
  whose first choice was over capacity), 'max_load' (max over experts of the share of
  first choices, times E: 1.0 is perfectly balanced, E is all tokens on one expert).
  """
  if logits.ndim != 3:
    raise ValueError(f"top2_gating expects logits [groups, tokens, experts], got {logits.shape}")
  if second_expert not in ("all", "random", "sampling"):
    raise ValueError(f"second_expert={second_expert!r}: use 'all', 'random' or 'sampling'")
  if second_expert != "all" and key is None:
    raise ValueError(f"second_expert={second_expert!r} needs a PRNG key")
  logits = logits.astype(jnp.float32)
  g, s, e = logits.shape
  gates = jax.nn.softmax(logits, axis=-1)

  index_1 = jnp.argmax(gates, axis=-1)
  mask_1 = jax.nn.one_hot(index_1, e, dtype=jnp.float32)
  # Balance loss and load from the first choices, before any are dropped.
  me = jnp.mean(gates, axis=1)              # [g, e]
  ce = jnp.mean(mask_1, axis=1)             # [g, e]
  aux_loss = jnp.mean(me * ce) * e * e
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))

  if second_expert == "sampling":  # Gumbel-max: a draw from softmax(logits) without expert 1
    noisy = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    index_2 = jnp.argmax(jnp.where(mask_1 > 0, -jnp.inf, noisy), axis=-1)
  else:
    index_2 = jnp.argmax(jnp.where(mask_1 > 0, -1.0, gates), axis=-1)
  mask_2 = jax.nn.one_hot(index_2, e, dtype=jnp.float32)

  gate_1 = jnp.sum(gates * mask_1, axis=-1)
  gate_2 = jnp.sum(gates * mask_2, axis=-1)
  denom = gate_1 + gate_2
  gate_1, gate_2 = gate_1 / denom, gate_2 / denom
  if second_expert == "random":
    keep = jax.random.uniform(key, (g, s), jnp.float32) < 2.0 * gate_2
    mask_2 = mask_2 * keep[..., None]

  # Slot of each token in its expert's queue: exclusive cumsum over the group.
  pos_1 = (jnp.cumsum(mask_1, axis=1) - 1.0) * mask_1
  mask_1 = mask_1 * (pos_1 < capacity)
  taken = jnp.sum(mask_1, axis=1, keepdims=True)           # [g, 1, e] slots used by first choices
  pos_2 = (jnp.cumsum(mask_2, axis=1) - 1.0 + taken) * mask_2
  mask_2 = mask_2 * (pos_2 < capacity)

  def slots(mask, pos):  # [g, s, e] -> [g, s, e, c] one-hot of the slot, zero if dropped
    slot = jnp.sum(pos * mask, axis=-1).astype(jnp.int32)
    return mask[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.float32)[:, :, None, :]

  d1, d2 = slots(mask_1, pos_1), slots(mask_2, pos_2)
  kept_1, kept_2 = jnp.sum(mask_1, axis=-1), jnp.sum(mask_2, axis=-1)   # [g, s] 0/1
  combine = gate_1[..., None, None] * d1 + gate_2[..., None, None] * d2
  metrics = {
      "dropped_fraction": jnp.mean((kept_1 + kept_2) == 0),
      "top1_overflow": 1.0 - jnp.mean(kept_1),
      "max_load": jnp.max(jnp.mean(ce, axis=0)) * e,
  }
  return Gating(combine, (d1 + d2) > 0, jnp.stack([index_1, index_2], -1).astype(jnp.int32),
                jnp.stack([kept_1, kept_2], -1) > 0, aux_loss, z_loss, metrics)


def _expert_init(key, shape, dtype):
  """LeCun truncated normal per expert: fan-in is the middle dim of [e, in, out]."""
  std = math.sqrt(1.0 / shape[1]) / 0.87962566103423978
  return (jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * std).astype(dtype)


class MoEFeedForward(nnx.Module):
  """x[b, l, embed] -> (y[b, l, embed], stats): top-2 gated experts, each a gated FFN.

  `cfg` is a `configs.moe.MoEConfig`. Expert weights are [e, embed, mlp] (logical
  'expert', 'embed', 'mlp'); the router [embed, e] stays replicated (it is small and
  every token needs all of it).
  """

  def __init__(self, d_model: int, cfg, *, activation: str = "silu",
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.cfg = cfg
    self.act = activation_fn(activation)
    self.dtype = dtype
    e, h = cfg.num_experts, cfg.d_ff
    self.router = DenseGeneral(d_model, e, in_axes=("embed",), out_axes=(None,),
                               dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
    self.wi_gate = nnx.Param(_expert_init(rngs.params(), (e, d_model, h), param_dtype),
                             logical_axes=("expert", "embed", "mlp"))
    self.wi_up = nnx.Param(_expert_init(rngs.params(), (e, d_model, h), param_dtype),
                           logical_axes=("expert", "embed", "mlp"))
    self.wo = nnx.Param(_expert_init(rngs.params(), (e, h, d_model), param_dtype),
                        logical_axes=("expert", "mlp", "embed"))

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
    """`deterministic` (evaluation): every token goes to both of its top-2 experts (policy
    'all'), whatever `cfg.second_expert` draws in training."""
    cfg, dt = self.cfg, self.dtype
    xg = self.groups(x)
    logits = self.router(xg, out_dtype=jnp.float32)                     # [g, s, e] float32
    if key is None:
      key = jax.random.key(cfg.seed)
    policy = "all" if deterministic else cfg.second_expert
    gating = top2_gating(logits, cfg.capacity(xg.shape[1]), policy, key)
    dispatch = shard(gating.dispatch.astype(dt), GSEC)
    combine = shard(gating.combine.astype(dt), GSEC)

    expert_in = shard(jnp.einsum("gsec,gsm->egcm", dispatch, xg.astype(dt)), EGCM)
    gate = jnp.einsum("egcm,emh->egch", expert_in, self.wi_gate[...].astype(dt))
    up = jnp.einsum("egcm,emh->egch", expert_in, self.wi_up[...].astype(dt))
    hidden = shard(self.act(gate) * up, EGCH)
    expert_out = shard(jnp.einsum("egch,ehm->egcm", hidden, self.wo[...].astype(dt)), EGCM)
    expert_out = shard(jnp.swapaxes(expert_out, 0, 1), GECM)            # [g, e, c, m]
    y = shard(jnp.einsum("gecm,gsec->gsm", expert_out, combine), ("batch", None, "embed"))
    stats = {"aux_loss": gating.aux_loss, "z_loss": gating.z_loss, **gating.metrics}
    return y.reshape(x.shape), stats
