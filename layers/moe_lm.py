"""A decoder-only LM whose every k-th layer has an MoE FFN (`configs.moe.MoELMConfig`).

The first `moe.first_dense_layers` layers are dense `transformer.Block`s (DeepSeek-V3
keeps its first 3 dense); after them the layers repeat in units of (k - 1) dense
`transformer.Block`s and one `MoEBlock`
(attention + MoE FFN). With `scan_layers` the units are stacked (leading dim
'layers', as `transformer.stacked_blocks` does for blocks) and run by `lax.scan`,
so XLA compiles one unit however deep the model is. Each MoE layer returns its
gating statistics; the scan stacks them and the LM averages them over layers.

Training loss = cross entropy + aux_loss_weight * mean_layers(balance loss)
                              + z_loss_weight * mean_layers(router z-loss).
Eval loss = cross entropy alone, every token routed to both its top-2 experts (`eval_loss`).
On packed text (segment ids, per-document positions, a loss mask) attention stays within
a document and the cross entropy counts only the unmasked targets, as in the dense LM.
The gating randomness ('random'/'sampling' second expert) needs a fresh key per
step without any RNG state in the model (the trainer carries only params): it is
`fold_in(key(moe.seed), hash(batch tokens))`, split once per MoE layer. The hash is
exact integer arithmetic, so every sharding of the batch derives the same key, and
jax's partitionable threefry makes the random bits independent of the sharding too.

Auxiliary-loss-free balancing (`moe.bias_update_rate`): each MoE layer returns its next
balance bias; `loss_and_metrics` hands them to the train step under `STATE_UPDATES` as a
params subtree, which the step writes over the updated params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from shardax.layers.attention import Attention, default_positions
from shardax.layers.embedding import Embed
from shardax.layers.linear import DenseGeneral
from shardax.layers.moe import MoEFeedForward
from shardax.layers.norm import make_norm
from shardax.layers.routers import BalanceBias
from shardax.layers.transformer import (LAYER_INPUT, REMAT_POLICIES, RESIDUAL, Block, block_cache_spec,
                                        block_fn, scan_cached, stacked, stacked_blocks)
from shardax.sharding import shard

# The metrics key under which a model hands the train step params to overwrite
# (trainer/step.py pops it): here the next balance biases.
STATE_UPDATES = "state_updates"   # = trainer.step.STATE_UPDATES (layers do not import the trainer)


class MoEBlock(nnx.Module):
  """x + attn(norm(x)), then x + moe(norm(x)); returns (x, gating stats)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    t = cfg.transformer
    dt, pdt = jnp.dtype(t.dtype), jnp.dtype(t.param_dtype)
    self.attn_norm = make_norm(t.norm, t.d_model, dtype=dt, param_dtype=pdt, eps=t.norm_eps)
    self.attn = Attention(t.d_model, t.num_heads, t.kv_heads, t.dim_per_head,
                          rope_theta=t.rope_theta, implementation=t.attention,
                          dtype=dt, param_dtype=pdt, rngs=rngs, options=t.attention_options(),
                          norm_eps=t.norm_eps, qkv_bias=t.qkv_bias, out_bias=t.out_bias, qk_norm=t.qk_norm,
                          rope_scaling=t.rope_scaling_params,
                          quantization=t.quantization)
    self.mlp_norm = make_norm(t.norm, t.d_model, dtype=dt, param_dtype=pdt, eps=t.norm_eps)
    self.moe = MoEFeedForward(t.d_model, cfg.moe, activation=t.activation,
                              dtype=dt, param_dtype=pdt, quantization=t.quantization, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, key: jax.Array,
               deterministic: bool = False,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    x = checkpoint_name(shard(x, RESIDUAL), LAYER_INPUT)  # what the offload policies move to host
    x = shard(x + self.attn(self.attn_norm(x), positions, segment_ids), RESIDUAL)
    y, stats = self.moe(self.mlp_norm(x), key, deterministic)
    return shard(x + y, RESIDUAL), stats

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """The block at decode (the model's config makes the MoE FFN drop nothing there:
    see `configs.moe.MoELMConfig.for_decode`)."""
    x = shard(x, RESIDUAL)
    y, cache = self.attn.cached(self.attn_norm(x), positions, cache)
    x = shard(x + y, RESIDUAL)
    y, _ = self.moe(self.mlp_norm(x))
    return shard(x + y, RESIDUAL), cache


class Unit(nnx.Module):
  """(moe.every - 1) dense blocks, then one MoE block: the stack's repeating unit."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.dense = nnx.List([Block(cfg.transformer, rngs=rngs) for _ in range(cfg.moe.every - 1)])
    self.moe_block = MoEBlock(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, key: jax.Array,
               deterministic: bool = False,
               segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    for block in self.dense:
      x = block(x, positions, segment_ids)
    return self.moe_block(x, positions, key, deterministic, segment_ids)

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    dense = []
    for block, block_cache in zip(self.dense, cache["dense"]):
      x, block_cache = block.cached(x, positions, block_cache)
      dense.append(block_cache)
    x, moe_cache = self.moe_block.cached(x, positions, cache["moe"])
    return x, {"dense": dense, "moe": moe_cache}


def stacked_units(cfg, num: int, *, rngs: nnx.Rngs) -> Unit:
  """`num` Units stacked on a leading 'layers' dim."""
  return stacked(lambda r: Unit(cfg, rngs=r), num, rngs=rngs)


def _unit_fn(graphdef: nnx.GraphDef, remat: str, prevent_cse: bool, deterministic: bool = False):
  def apply(state, x, positions, key, segment_ids=None):
    return nnx.merge(graphdef, state)(x, positions, key, deterministic, segment_ids)
  if remat == "none":
    return apply
  return jax.checkpoint(apply, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def batch_key(seed: int, tokens: jax.Array) -> jax.Array:
  """A PRNG key that differs per batch: seed folded with a position-weighted token hash."""
  t = tokens.astype(jnp.uint32)
  weights = jnp.arange(t.size, dtype=jnp.uint32).reshape(t.shape) * jnp.uint32(2654435761) + 1
  return jax.random.fold_in(jax.random.key(seed), jnp.sum(t * weights, dtype=jnp.uint32))


class MoELM(nnx.Module):
  """tokens int32[b, l] -> logits float32[b, l, vocab], with MoE FFNs every k-th layer."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.cfg = cfg
    t = cfg.transformer
    dt, pdt = jnp.dtype(t.dtype), jnp.dtype(t.param_dtype)
    n = cfg.num_moe_layers
    self.embed = Embed(t.vocab_size, t.d_model, dtype=dt, param_dtype=pdt, scale=t.scale_embedding, rngs=rngs)
    k = cfg.moe.first_dense_layers
    if not k:
      self.first_dense = None
    elif t.scan_layers:
      self.first_dense = stacked_blocks(t, k, rngs=rngs)
    else:
      self.first_dense = nnx.List([Block(t, rngs=rngs) for _ in range(k)])
    if t.scan_layers:
      self.units = stacked_units(cfg, n, rngs=rngs)
    else:
      self.units = nnx.List([Unit(cfg, rngs=rngs) for _ in range(n)])
    self.final_norm = make_norm(t.norm, t.d_model, dtype=dt, param_dtype=pdt, eps=t.norm_eps)
    self.head = None if t.tied_embedding else DenseGeneral(
        t.d_model, t.vocab_size, in_axes=("embed",), out_axes=("vocab",),
        dtype=dt, param_dtype=pdt, rngs=rngs)

  def forward(self, tokens: jax.Array, key: jax.Array, positions: jax.Array | None = None,
              deterministic: bool = False,
              segment_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(logits, stats): stats are each gating statistic averaged over the MoE layers.
    `deterministic`: route every token to both its top-2 experts (evaluation).
    Packed rows (`segment_ids`, per-document `positions`): attention stays within a
    document, as in the dense LM."""
    t = self.cfg.transformer
    if positions is None:
      positions = default_positions(tokens.shape[0], tokens.shape[1])
    keys = jax.random.split(key, self.cfg.num_moe_layers)
    x = shard(self.embed(tokens), RESIDUAL)
    x = self._first_dense(x, positions, segment_ids)
    if t.scan_layers:
      graphdef, state = nnx.split(self.units)
      body = _unit_fn(graphdef, t.remat, prevent_cse=False, deterministic=deterministic)
      x, stats = jax.lax.scan(lambda c, xs: body(xs[0], c, positions, xs[1], segment_ids),
                              x, (state, keys))
    else:
      per_layer = []
      for unit, k in zip(self.units, keys):
        graphdef, state = nnx.split(unit)
        x, s = _unit_fn(graphdef, t.remat, prevent_cse=True,
                        deterministic=deterministic)(state, x, positions, k, segment_ids)
        per_layer.append(s)
      stats = jax.tree.map(lambda *v: jnp.stack(v), *per_layer)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x, out_dtype=jnp.float32)
    next_bias = stats.pop("next_bias", None)          # [moe layers, e]: kept per layer
    stats = jax.tree.map(jnp.mean, stats)
    if next_bias is not None:
      stats["next_bias"] = next_bias
    return shard(logits, ("batch", "length", "vocab")), stats

  def _first_dense(self, x: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """The first `moe.first_dense_layers` dense blocks (scanned like the units)."""
    if self.first_dense is None:
      return x
    t = self.cfg.transformer
    if t.scan_layers:
      graphdef, state = nnx.split(self.first_dense)
      body = block_fn(graphdef, t.remat, prevent_cse=False)
      return jax.lax.scan(lambda c, s: (body(s, c, positions, segment_ids), None), x, state)[0]
    for block in self.first_dense:
      x = block(x, positions, segment_ids)
    return x

  def balance_updates(self, next_bias: jax.Array) -> dict:
    """The params subtree of every MoE layer's balance bias set to `next_bias` [layers, e]."""
    if self.cfg.transformer.scan_layers:
      self.units.moe_block.moe.balance_bias.value = next_bias
    else:
      for unit, bias in zip(self.units, next_bias):
        unit.moe_block.moe.balance_bias.value = bias
    return nnx.to_pure_dict(nnx.state(self, BalanceBias))

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    return self.forward(tokens, jax.random.key(self.cfg.moe.seed), positions,
                        segment_ids=segment_ids)[0]

  def cache_spec(self, batch: int, length: int):
    """The decode cache: per unit {'dense': [one per dense block], 'moe': ...}, stacked
    on a leading 'layers' dim when the units are scanned."""
    t = self.cfg.transformer
    one = block_cache_spec(t, batch, length)
    unit = {"dense": [one] * (self.cfg.moe.every - 1), "moe": one}
    k = self.cfg.moe.first_dense_layers
    if t.scan_layers:
      units = jax.tree.map(lambda c: c.stacked(self.cfg.num_moe_layers), unit)
      first = jax.tree.map(lambda c: c.stacked(k), one) if k else None
    else:
      units = [unit for _ in range(self.cfg.num_moe_layers)]
      first = [one] * k if k else None
    return units if first is None else {"first_dense": first, "units": units}

  def cached(self, tokens: jax.Array, positions: jax.Array, cache) -> tuple[jax.Array, object]:
    """(logits, cache): a prefill or one generate step, as `TransformerLM.cached`."""
    x = shard(self.embed(tokens), RESIDUAL)
    if self.first_dense is not None:
      x, first = self._first_dense_cached(x, positions, cache["first_dense"])
      x, units = self._units_cached(x, positions, cache["units"])
      cache = {"first_dense": first, "units": units}
    else:
      x, cache = self._units_cached(x, positions, cache)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x, out_dtype=jnp.float32)
    return shard(logits, ("batch", "length", "vocab")), cache

  def _first_dense_cached(self, x, positions, cache):
    if self.cfg.transformer.scan_layers:
      return scan_cached(*nnx.split(self.first_dense), x, positions, cache)
    out = []
    for block, block_cache in zip(self.first_dense, cache):
      x, block_cache = block.cached(x, positions, block_cache)
      out.append(block_cache)
    return x, out

  def _units_cached(self, x, positions, cache):
    if self.cfg.transformer.scan_layers:
      x, cache = scan_cached(*nnx.split(self.units), x, positions, cache)
    else:
      out = []
      for unit, unit_cache in zip(self.units, cache):
        x, unit_cache = unit.cached(x, positions, unit_cache)
        out.append(unit_cache)
      cache = out
    return x, cache

  def loss_and_metrics(self, batch: dict) -> tuple[jax.Array, dict]:
    """Cross entropy + weighted balance and z losses; metrics under 'moe/...'.

    Packed batches (trainer/data/packing.py) carry 'positions', 'segment_ids' and
    'loss_mask' (0 on padding), as for the dense LM: attention stays within a document
    and the cross entropy is the mean over unmasked targets; `loss_weight` (their count)
    lets evaluation weigh batches by tokens."""
    m = self.cfg.moe
    logits, stats = self.forward(batch["inputs"], batch_key(m.seed, batch["inputs"]),
                                 batch.get("positions"), segment_ids=batch.get("segment_ids"))
    ce, weight = masked_cross_entropy(logits, batch["targets"], batch.get("loss_mask"))
    loss = ce + m.aux_loss_weight * stats["aux_loss"] + m.z_loss_weight * stats["z_loss"]
    next_bias = stats.pop("next_bias", None)
    metrics = {"ce_loss": ce, "loss_weight": weight,
               **{f"moe/{k}": v.astype(jnp.float32) for k, v in stats.items()}}
    if next_bias is not None:
      metrics[STATE_UPDATES] = self.balance_updates(jax.lax.stop_gradient(next_bias))
    return loss, metrics

  def eval_loss(self, batch: dict) -> tuple[jax.Array, dict]:
    """The validation loss and {'loss_weight'}: cross entropy alone, deterministic routing.

    The balance and z losses are training regularizers (logged as `moe/aux_loss`,
    `moe/z_loss` with the train metrics), not a measure of the model; and every token
    goes to both its top-2 experts, so an eval of the same weights and batch never
    depends on a random draw (the 'random'/'sampling' second expert is a training-time
    choice, as in GShard). Packed batches as in `loss_and_metrics`: the mean is over
    unmasked targets and `loss_weight` is their count."""
    logits, stats = self.forward(batch["inputs"], jax.random.key(self.cfg.moe.seed),
                                 batch.get("positions"), deterministic=True,
                                 segment_ids=batch.get("segment_ids"))
    ce, weight = masked_cross_entropy(logits, batch["targets"], batch.get("loss_mask"))
    overflow = stats.get("expert_buffer_overflow", jnp.float32(0))   # the loop raises on it
    return ce, {"loss_weight": weight, "moe/expert_buffer_overflow": overflow}


def masked_cross_entropy(logits: jax.Array, targets: jax.Array,
                         mask: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(mean next-token cross entropy over the targets `mask` keeps (all without one),
  float32 count of those targets)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  if mask is None:
    return jnp.mean(ce), jnp.float32(ce.size)
  mask = mask.astype(jnp.float32)
  weight = jnp.sum(mask)
  return jnp.sum(ce * mask) / jnp.maximum(weight, 1.0), weight
