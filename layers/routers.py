"""Router math of the MoE layer, in one place: which experts a token goes to, with what gate.

Two routers:
- `route` (dropless dispatch): top-k of softmax or sigmoid scores for any k, gates
  renormalized over the chosen k or not, times a scale; optionally a per-expert bias added
  to the scores for *choosing* only (DeepSeek-V3's auxiliary-loss-free balancing, arXiv
  2412.19437 section 2.1.2): the gate of a chosen expert is its unbiased score, and the
  bias moves each train step by `rate * sign(mean load - load_e)`, so an overloaded
  expert gets chosen less next step without any gradient through the router.
- `top2_gating` (capacity dispatch): GShard's top-2 with slots per expert and drops
  (arXiv 2006.16668, Algorithm 1), below.

Both can limit each token to `topk_group` of `n_group` equal groups of experts
(`group_limit`, DeepSeek-V3's node-limited routing, arXiv 2412.19437 section 2.1.2 and
transformers' DeepseekV3TopkRouter): a group scores the sum of its two best (biased)
scores, the best `topk_group` groups are kept, and the top-k is taken within them. With the
groups laid out along an expert-parallel mesh axis this bounds how many devices (nodes) a
token's copies travel to.

Both give the Switch/GShard balance loss `E * sum_e(me * ce)` (me: mean normalized score
of e, ce: e's share of the assignments; 1.0 when uniform, E when collapsed) and the
router z-loss `mean(logsumexp(logits)^2)` (ST-MoE).

`BalanceBias` is the bias' variable: an `nnx.Param` (so it lives in the params the trainer
carries, checkpoints, shards and restores) that no gradient reaches (it only picks
indices) and that the train step overwrites with the layer's next value (see
`trainer/step.py`, `STATE_UPDATES`), whatever the optimizer did to it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.sharding import manual


class BalanceBias(nnx.Param):
  """Per-expert selection bias of auxiliary-loss-free balancing; set by the train step."""


class Routing(NamedTuple):
  """Output of `route` for logits [..., E]."""
  index: jax.Array      # int32 [..., k]: the chosen experts, best first
  gates: jax.Array      # float32 [..., k]: their gate weights
  load: jax.Array       # float32 [E]: each expert's share of the assignments (sums to 1)
  prob: jax.Array       # float32 [E]: each expert's mean normalized score (me)
  aux_loss: jax.Array   # scalar E * sum_e(me * load_e)
  z_loss: jax.Array     # scalar mean(logsumexp(logits)^2)
  metrics: dict         # scalar diagnostics: 'max_load' (max share x E; 1.0 is uniform),
                        # 'last_gate' (the k-th choice's share of the chosen scores)


def scores_of(logits: jax.Array, score: str) -> jax.Array:
  """Router scores from logits: softmax over the experts, or a sigmoid per expert."""
  if score == "softmax":
    return jax.nn.softmax(logits, axis=-1)
  if score == "sigmoid":
    return jax.nn.sigmoid(logits)
  raise ValueError(f"router score {score!r}: use 'softmax' or 'sigmoid'")


def route(logits: jax.Array, *, top_k: int, score: str = "softmax", renormalize: bool = True,
          gate_scale: float = 1.0, bias: jax.Array | None = None, n_group: int = 1,
          topk_group: int = 1) -> Routing:
  """Top-k routing of router logits [..., E] (float32 inside), every token kept; within the
  `topk_group` best of `n_group` expert groups when n_group > 1 (`group_limit`)."""
  logits = logits.astype(jnp.float32)
  e = logits.shape[-1]
  scores = scores_of(logits, score)
  choose = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
  if n_group > 1:
    choose = jnp.where(group_limit(choose, n_group, topk_group), choose, -jnp.inf)
  index = top_k_indices(choose, top_k)
  gates = jnp.take_along_axis(scores, index, axis=-1)
  share = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
  # How much the k-th expert still counts: near 0, top-k has collapsed to fewer experts.
  last_gate = jnp.mean(share[..., -1])
  if renormalize:
    gates = share
  gates = gates * gate_scale
  # Sums over the token dims as they are: flattening [batch, length] first made the
  # partitioner all-gather the sequence of a context-parallel (length-split) batch.
  tokens = tuple(range(index.ndim - 1))
  load = jnp.zeros((e,), jnp.float32).at[index].add(1.0) / index.size
  probs = scores if score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
  me = jnp.mean(probs, axis=tokens)
  aux_loss = e * jnp.sum(me * load)
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
  return Routing(index.astype(jnp.int32), gates, load, me, aux_loss, z_loss,
                 {"max_load": jnp.max(load) * e, "last_gate": last_gate})


def group_limit(scores: jax.Array, n_group: int, topk_group: int) -> jax.Array:
  """bool [..., E]: the experts of the `topk_group` groups (of `n_group` consecutive, equal
  groups) whose two best `scores` sum highest; ties go to the lower group, as lax.top_k.

  Written with maxima and comparisons along the last dims only (no top_k, no sort), so the
  partitioner splits it over the token dims like any elementwise op."""
  *lead, e = scores.shape
  if e % n_group:
    raise ValueError(f"model.moe.n_group={n_group} must divide the {e} experts")
  grouped = scores.reshape(*lead, n_group, e // n_group)
  best = jnp.max(grouped, axis=-1)
  first = jnp.argmax(grouped, axis=-1)[..., None] == jnp.arange(e // n_group)
  second = jnp.max(jnp.where(first, -jnp.inf, grouped), axis=-1)
  group_score = best + second                                                    # [..., G]
  g = jnp.arange(n_group)
  ahead = (group_score[..., None, :] > group_score[..., :, None]) | (
      (group_score[..., None, :] == group_score[..., :, None]) & (g[None, :] < g[:, None]))
  keep = jnp.sum(ahead, axis=-1) < topk_group                                    # rank < topk_group
  return jnp.repeat(keep, e // n_group, axis=-1)


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
  """lax.top_k's indices of x [batch, length, ..., E], computed where the tokens lie: the
  SPMD partitioner does not split top_k along the batch and would all-gather every
  token's scores to each device, so under a mesh it runs per device in a manual region
  (sharding/manual.py) cut as the rules cut 'batch' and (context parallelism) 'length'."""
  lead = ("batch", "length")[:x.ndim - 1]
  tokens = manual.layout(lead + (None,) * (x.ndim - len(lead)), x.shape, name=f"MoE {lead}")
  if not tokens.split or not manual.active():
    return jax.lax.top_k(x, k)[1]
  return manual.run(lambda v: jax.lax.top_k(v, k)[1], in_layouts=(tokens,), out_layouts=tokens)(x)


def next_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3's update: raise the bias of underloaded experts, lower the overloaded.

  `load` is each expert's share of the assignments (any positive scale: only the sign of
  mean - load_e matters); an expert exactly at the mean keeps its bias."""
  load = jax.lax.stop_gradient(load)
  return bias + rate * jnp.sign(jnp.mean(load) - load).astype(bias.dtype)


# ------------------------------------------------------------------ GShard top-2 with capacity

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
                key: jax.Array | None = None, n_group: int = 1, topk_group: int = 1) -> Gating:
  """GShard top-2 gating of router logits [g, s, e] with `capacity` slots per expert; both
  choices (and a sampled second) within the `topk_group` best of `n_group` expert groups
  when n_group > 1 (`group_limit` of the softmax gates; the gate values stay the softmax's).

  metrics: 'dropped_fraction' (tokens that reach no expert), 'top1_overflow' (tokens
  whose first choice was over capacity), 'max_load' (max over experts of the share of
  first choices, times E: 1.0 is perfectly balanced, E is all tokens on one expert),
  'routed_copies_count' / 'dropped_copies_count' (token copies sent to an expert, after the
  second-expert policy, and those of them past capacity: counts over all groups).
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
  allowed = group_limit(gates, n_group, topk_group) if n_group > 1 else jnp.ones(gates.shape, bool)

  index_1 = jnp.argmax(jnp.where(allowed, gates, -1.0), axis=-1)
  mask_1 = jax.nn.one_hot(index_1, e, dtype=jnp.float32)
  # Balance loss and load from the first choices, before any are dropped.
  me = jnp.mean(gates, axis=1)              # [g, e]
  ce = jnp.mean(mask_1, axis=1)             # [g, e]
  aux_loss = jnp.mean(me * ce) * e * e
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))

  if second_expert == "sampling":  # Gumbel-max: a draw from softmax(logits) without expert 1
    noisy = logits + jax.random.gumbel(key, logits.shape, jnp.float32)
    index_2 = jnp.argmax(jnp.where((mask_1 > 0) | ~allowed, -jnp.inf, noisy), axis=-1)
  else:
    index_2 = jnp.argmax(jnp.where((mask_1 > 0) | ~allowed, -1.0, gates), axis=-1)
  mask_2 = jax.nn.one_hot(index_2, e, dtype=jnp.float32)

  gate_1 = jnp.sum(gates * mask_1, axis=-1)
  gate_2 = jnp.sum(gates * mask_2, axis=-1)
  denom = gate_1 + gate_2
  gate_1, gate_2 = gate_1 / denom, gate_2 / denom
  if second_expert == "random":
    keep = jax.random.uniform(key, (g, s), jnp.float32) < 2.0 * gate_2
    mask_2 = mask_2 * keep[..., None]

  routed = jnp.sum(mask_1) + jnp.sum(mask_2)               # token copies sent, before capacity
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
      "routed_copies_count": routed,
      "dropped_copies_count": routed - jnp.sum(kept_1) - jnp.sum(kept_2),
  }
  return Gating(combine, (d1 + d2) > 0, jnp.stack([index_1, index_2], -1).astype(jnp.int32),
                jnp.stack([kept_1, kept_2], -1) > 0, aux_loss, z_loss, metrics)
