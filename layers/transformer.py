"""THE decoder-only LM: embed, the layer stack, norm, head; one forward, loss, eval and decode.

Dense and MoE models are this one class: `cfg.moe` (None for dense) makes the stack's
repeating unit carry an MoE FFN (layers/blocks.py), so every LM option (attention
implementation and window, soft-cap, context-parallel mode and its load balancing, z-loss,
parallel blocks, remat/offload, quantization, packed segments, the decode cache, Hugging
Face import/export) reaches MoE models by construction.

Loss = mean next-token cross entropy over the unmasked targets
       + cfg.z_loss x mean(logsumexp(logits)^2)                      (PaLM's z-loss)
       + moe.aux_loss_weight x mean_layers(balance loss) + moe.z_loss_weight x mean_layers(router z-loss)
       (moe.aux_loss_pooling='over_layers': the balance loss of the expert shares pooled over the layers).
`model.loss_chunk` makes the logits and these losses a chunk of the sequence at a time
(`head_losses`), so no [tokens, vocab] float32 array lives at once; same values.
Eval loss = cross entropy alone; MoE routing deterministic (every token to its top-2
experts on the capacity path), so an eval never depends on a random draw.

MoE gating randomness ('random'/'sampling' second expert) needs a fresh key per step without
RNG state in the model: `fold_in(key(moe.seed), hash(batch tokens))`, split once per MoE
layer. The hash is exact integer arithmetic over the batch in its natural order, so every
sharding of the batch derives the same key. Auxiliary-loss-free balancing
(`moe.bias_update_rate`): each MoE layer returns its next balance bias; `loss_and_metrics`
hands them to the train step under `STATE_UPDATES`, which writes them over the params.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax import pipeline
from shardax.configs.schema import TransformerConfig
from shardax.layers import context_parallel
from shardax.layers import mtp as mtp_lib
from shardax.layers.attention import default_positions
from shardax.layers.blocks import (LAYER_INPUT, PROJECTIONS, REMAT_POLICIES, RESIDUAL, Block,  # noqa: F401
                                   PatternUnit, Unit, block_fn, make_unit, scan_cached, scan_units,
                                   block_cache_spec, stacked, stacked_blocks, unit_cache_spec)
from shardax.layers.embedding import Embed
from shardax.layers.linear import DenseGeneral
from shardax.layers.norm import make_norm
from shardax.layers.routers import BalanceBias
from shardax.sharding import shard

# The metrics key under which a model hands the train step a subtree of its params to
# overwrite (state it updates itself, not by gradient: the MoE balance biases).
# trainer/step.py imports it from here (layers do not import the trainer).
STATE_UPDATES = "state_updates"
# MoE statistics kept per MoE layer ([moe layers, ...]), not averaged over them: the next
# balance bias, the token copies each layer routed and dropped (counts), and the expert shares
# a balance loss pooled over the layers is made of.
PER_LAYER_STATS = ("next_bias", "routed_copies_count", "dropped_copies_count", "expert_load", "expert_prob")
COUNT_STATS = ("routed_copies_count", "dropped_copies_count")


def _run_list(modules, x, positions, segment_ids, remat, keys=None, deterministic=False):
  """Unscanned units in order: (x, their stats stacked on a leading layers dim)."""
  stats = []
  for i, module in enumerate(modules):
    graphdef, state = nnx.split(module)
    key = None if keys is None else keys[i]
    x, s = block_fn(graphdef, remat, deterministic=deterministic)(state, x, positions, segment_ids, key)
    stats.append(s)
  return x, jax.tree.map(lambda *v: jnp.stack(v), *stats) if stats else {}


def _cached_list(modules, x, positions, cache):
  """Unscanned units at decode: (x, their caches, their dropped copies stacked [units])."""
  out, dropped = [], []
  for module, module_cache in zip(modules, cache):
    x, module_cache, d = module.cached(x, positions, module_cache)
    out.append(module_cache)
    dropped.append(d)
  return x, out, jnp.stack(dropped)


def _flat_layers(tree):
  """Leaves [units, per unit, ...] -> [units * per unit, ...]: a PatternUnit's per-block
  statistics (or dropped copies), stacked over units, as one per-layer list."""
  return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tree)


def _concat_layers(a, b):
  """Per-layer statistics of the units followed by the tail's."""
  return jax.tree.map(lambda u, t: jnp.concatenate([u, t]), a, b) if b else a


class LayerStack(nnx.Module):
  """cfg.num_layers layers: an MoE model's first dense blocks (`first_dense`), then the
  units (`blocks`): stacked + scanned if cfg.scan_layers, else a Python list; with
  cfg.pipeline.stages > 1, stacked in the stage layout and run by `shardax.pipeline`.
  With a layer pattern, the units are PatternUnits and the layers after the last whole one a
  PatternUnit `tail` run after them (None without one); the statistics and dropped copies
  stay one entry per MoE layer (per layer for a dense model), in layer order."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.scan_layers = cfg.scan_layers
    self.remat = cfg.remat
    self.pattern = bool(cfg.layer_pattern)
    k, n = cfg.num_first_dense, cfg.num_stack_units
    # gating keys (one per MoE layer) the units take: [n, MoE blocks per unit] with a pattern
    self.unit_moe = 0 if cfg.moe is None else cfg.layers_per_unit // cfg.moe.every
    p = cfg.pipeline
    self.schedule = (pipeline.Schedule(p.stages, p.microbatches, p.circular_repeats, p.delay_shift)
                     if p.stages > 1 else None)
    self.grads_in_layout = p.grads_in_layout
    self.units_per_visit = n // (p.stages * p.circular_repeats)
    if not k:
      self.first_dense = None
    elif cfg.scan_layers:
      self.first_dense = stacked_blocks(cfg, k, rngs=rngs)
    else:
      self.first_dense = nnx.List([Block(cfg, rngs=rngs) for _ in range(k)])
    if self.schedule is not None:  # params [S, (R,) L/(S*R), ...], logical 'stage' first
      self.blocks = pipeline.restack_module(stacked(lambda r: make_unit(cfg, r), n, rngs=rngs),
                                            p.stages, p.circular_repeats)
    elif cfg.scan_layers:
      self.blocks = stacked(lambda r: make_unit(cfg, r), n, rngs=rngs)
    else:
      self.blocks = nnx.List([make_unit(cfg, rngs) for _ in range(n)])
    t = cfg.num_tail_layers
    self.tail = PatternUnit(cfg, start=n * cfg.layers_per_unit, count=t, rngs=rngs) if t else None
    self.tail_moe = 0 if cfg.moe is None else t // cfg.moe.every   # its MoE blocks

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               keys: jax.Array | None = None, deterministic: bool = False) -> tuple[jax.Array, dict]:
    """(x, stats of every MoE layer stacked on a leading layers dim; {} for a dense model).
    keys: one gating key per MoE layer (MoE models)."""
    if not self.pattern:
      return self._units(x, positions, segment_ids, keys, deterministic)
    unit_keys = tail_keys = None
    if keys is not None:
      split = keys.shape[0] - self.tail_moe
      unit_keys, tail_keys = keys[:split].reshape(-1, self.unit_moe), keys[split:]
    x, stats = self._units(x, positions, segment_ids, unit_keys, deterministic)
    stats = _flat_layers(stats)
    if self.tail is None:
      return x, stats
    graphdef, state = nnx.split(self.tail)
    x, tail_stats = block_fn(graphdef, self.remat, deterministic=deterministic)(
        state, x, positions, segment_ids, tail_keys)
    return x, _concat_layers(stats, tail_stats)

  def _units(self, x, positions, segment_ids, keys, deterministic):
    """The first dense layers and the units: (x, stats stacked per unit)."""
    x = self._first(x, positions, segment_ids)
    if self.schedule is not None:  # packed rows and MoE statistics travel with their microbatch
      graphdef, state = nnx.split(self.blocks)
      remat = pipeline.stage_remat(self.remat, self.units_per_visit)  # one recompute in all (pipeline/loop.py)
      # MoE units route deterministically here (config check): no gating keys
      stage = lambda w, h, pos, seg=None: scan_units(graphdef, w, h, pos, remat=remat, segment_ids=seg,
                                                     deterministic=deterministic)
      names = ([v.get_metadata().get("logical_axes")
                for v in jax.tree.leaves(state, is_leaf=lambda a: isinstance(a, nnx.Variable))]
               if self.grads_in_layout else None)
      # the run averages its statistics over the microbatches (none below M rows); counts are
      # of the whole batch
      m = self.schedule.microbatches if x.shape[0] >= self.schedule.microbatches else 1
      x, stats = pipeline.run(stage, state, x, positions, self.schedule, RESIDUAL,
                              segment_ids=segment_ids, weight_axes=names, with_stats=True,
                              inputs_on_host=pipeline.offloads_stage_inputs(self.remat))
      return x, {k: v * m if k in COUNT_STATS else v for k, v in stats.items()}
    if self.scan_layers:
      graphdef, state = nnx.split(self.blocks)
      return scan_units(graphdef, state, x, positions, remat=self.remat, segment_ids=segment_ids,
                        keys=keys, deterministic=deterministic)
    return _run_list(self.blocks, x, positions, segment_ids, self.remat, keys, deterministic)

  def _first(self, x, positions, segment_ids):
    if self.first_dense is None:
      return x
    if self.scan_layers:
      graphdef, state = nnx.split(self.first_dense)
      return scan_units(graphdef, state, x, positions, remat=self.remat, segment_ids=segment_ids)[0]
    return _run_list(self.first_dense, x, positions, segment_ids, self.remat)[0]

  def cache_spec(self, cfg: TransformerConfig, batch: int, length: int, bounded: bool = True):
    """The decode cache: one per unit (stacked [L, ...] for scanned and pipelined stacks);
    with first dense layers {'first_dense': theirs, 'units': the units'}; with a pattern's
    tail {'units': the units', 'tail': [one per tail block]}. `bounded`: windowed and chunked
    layers keep a ring of window (chunk) slots (layers/attention.py); False: every layer
    `length` slots."""
    one = unit_cache_spec(cfg, batch, length, bounded)
    block = block_cache_spec(cfg, batch, length, bounded=bounded)
    k, n = cfg.num_first_dense, cfg.num_stack_units
    if self.schedule is None and not self.scan_layers:
      units, first = [one] * n, [block] * k
    else:
      units = jax.tree.map(lambda c: c.stacked(n), one)
      first = jax.tree.map(lambda c: c.stacked(k), block) if k else None
    if self.tail is not None:   # a pattern has no first dense layers (config check)
      start = n * cfg.layers_per_unit
      return {"units": units, "tail": [block_cache_spec(cfg, batch, length, cfg.layer_kind(start + i), bounded)
                                       for i in range(cfg.num_tail_layers)]}
    return {"first_dense": first, "units": units} if k else units

  def cached(self, x: jax.Array, positions: jax.Array, cache) -> tuple[jax.Array, object, jax.Array]:
    """Decode through the stack: (x, the cache, `dropped` float32 [MoE layers] (a dense
    model's: [layers], zeros): the token copies each MoE layer routed to an expert that gave no
    output (`moe_layer` names its layer);
    `Block.cached`). A pipelined stack runs its stages in order, on its weights unstacked
    to [L, ...] (one token per step leaves nothing to pipeline)."""
    if self.first_dense is not None:   # dense blocks: nothing to drop
      x, first, _ = self._cached(self.first_dense, x, positions, cache["first_dense"])
      x, units, dropped = self._cached(self.blocks, x, positions, cache["units"])
      return x, {"first_dense": first, "units": units}, dropped
    if self.tail is not None:
      x, units, dropped = self._cached(self.blocks, x, positions, cache["units"])
      x, tail, tail_dropped = self.tail.cached(x, positions, cache["tail"])
      return x, {"units": units, "tail": tail}, jnp.concatenate([_flat_layers(dropped), tail_dropped])
    x, cache, dropped = self._cached(self.blocks, x, positions, cache)
    return x, cache, _flat_layers(dropped) if self.pattern else dropped

  def _cached(self, modules, x, positions, cache):
    if self.schedule is not None:
      graphdef, state = nnx.split(modules)
      state = jax.tree.map(lambda a: pipeline.from_stages(a, self.schedule.repeats), state)
      return scan_cached(graphdef, state, x, positions, cache)
    if self.scan_layers:
      return scan_cached(*nnx.split(modules), x, positions, cache)
    return _cached_list(modules, x, positions, cache)


def moe_layer(cfg: TransformerConfig, index: int) -> int:
  """The 0-based model layer of entry `index` of the stack's per-layer statistics and decode
  `dropped` counts: a dense model's layer `index`; an MoE model's `index`-th MoE layer, which
  is layer first_dense + (index + 1) x moe.every - 1 with or without a layer pattern (the
  entries are one per MoE block in layer order: a PatternUnit's several blocks are flattened,
  its tail's follow the units'), scanned, a list or pipelined."""
  if cfg.moe is None:
    return index
  return cfg.num_first_dense + index * cfg.moe.every + cfg.moe.every - 1


def batch_key(seed: int, tokens: jax.Array) -> jax.Array:
  """A PRNG key that differs per batch: seed folded with a position-weighted token hash."""
  t = tokens.astype(jnp.uint32)
  weights = jnp.arange(t.size, dtype=jnp.uint32).reshape(t.shape) * jnp.uint32(2654435761) + 1
  return jax.random.fold_in(jax.random.key(seed), jnp.sum(t * weights, dtype=jnp.uint32))


class TransformerLM(nnx.Module):
  """tokens int32[b, l] -> logits float32[b, l, vocab]: embed, layers, norm, head."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                       scale=cfg.scale_embedding, rngs=rngs)
    self.layers = LayerStack(cfg, rngs=rngs)
    self.final_norm = make_norm(cfg.norm, cfg.d_model, dtype=dt, param_dtype=pdt, eps=cfg.norm_eps)
    self.head = None if cfg.tied_embedding else DenseGeneral(
        cfg.d_model, cfg.vocab_size, in_axes=("embed",), out_axes=("vocab",),
        dtype=dt, param_dtype=pdt, rngs=rngs)
    # built last, so the main params draw what they draw without MTP (layers/mtp.py)
    self.mtp = None if cfg.mtp is None else nnx.List([mtp_lib.MTPModule(cfg, rngs=rngs)
                                                      for _ in range(cfg.mtp.depth)])

  def forward(self, tokens: jax.Array, positions: jax.Array | None = None,
              segment_ids: jax.Array | None = None, *, key: jax.Array | None = None,
              deterministic: bool = False) -> tuple[jax.Array, dict]:
    """(logits, stats): stats are each MoE gating statistic averaged over the MoE layers
    (those of `PER_LAYER_STATS` kept per layer); {} for a dense model. `key`: the step's
    gating key."""
    x, stats = self.hidden(tokens, positions, segment_ids, key=key, deterministic=deterministic)
    return self.logits(x), stats

  def hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None, *, key: jax.Array | None = None,
             deterministic: bool = False) -> tuple[jax.Array, dict]:
    """(the last layer's output [b, l, embed], before the final norm; stats as in `forward`)."""
    if positions is None:
      positions = default_positions(tokens.shape[0], tokens.shape[1])
    keys = None
    if self.cfg.moe is not None:
      keys = jax.random.split(jax.random.key(self.cfg.moe.seed) if key is None else key,
                              self.cfg.num_units)
    x = shard(self.embed(tokens), RESIDUAL)
    x, stats = self.layers(x, positions, segment_ids, keys, deterministic)
    per_layer = {k: stats.pop(k) for k in PER_LAYER_STATS if k in stats}   # [moe layers, ...]
    stats = jax.tree.map(jnp.mean, stats)
    stats.update(per_layer)
    return x, stats

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    return self.forward(tokens, positions, segment_ids)[0]

  def cache_spec(self, batch: int, length: int, bounded: bool = True):
    """Tree of `CacheSpec` (shape, dtype, logical axes) of the decode cache; `bounded`: ring
    caches on windowed and chunked layers (LayerStack.cache_spec)."""
    return self.layers.cache_spec(self.cfg, batch, length, bounded)

  def cached(self, tokens: jax.Array, positions: jax.Array, cache
             ) -> tuple[jax.Array, object, jax.Array]:
    """(logits float32[b, l, vocab], cache, dropped float32 [cfg.num_units]): a prefill or a
    generate step (attention.py). `dropped`: per MoE layer (`moe_layer` gives its model
    layer), the token copies it routed to an expert that gave no output; 0
    under `TransformerConfig.for_decode`, the config decoding builds (trainer/decode.py
    raises on anything else: the logits of such a call are not the model's)."""
    x = shard(self.embed(tokens), RESIDUAL)
    x, cache, dropped = self.layers.cached(x, positions, cache)
    return self.logits(x), cache, dropped

  def logits(self, x: jax.Array, norm=None) -> jax.Array:
    """Final norm (or `norm`: an MTP module's head norm) and head (or the tied embedding):
    [b, l, embed] -> float32 [b, l, vocab], soft-capped to cap * tanh(logits / cap) with
    `cfg.final_logit_softcap` (Gemma 2)."""
    x = (self.final_norm if norm is None else norm)(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x, out_dtype=jnp.float32)
    cap = self.cfg.final_logit_softcap
    if cap is not None:
      logits = jnp.float32(cap) * jnp.tanh(logits / jnp.float32(cap))
    return shard(logits, ("batch", "length", "vocab"))

  def _losses(self, batch: dict, deterministic: bool, with_mtp: bool = False
              ) -> tuple[jax.Array, jax.Array, jax.Array | None, dict]:
    """(mean cross entropy, its token count, mean logsumexp^2 (None without z-loss), stats)
    under the context-parallel mode. The sequence goes into the load-balanced order when
    `length` is split, unless an MoE capacity dispatch decides by token order which tokens
    to drop: that keeps the natural order, so a sharded run drops what one device drops.
    `with_mtp` (a model with `cfg.mtp`): stats['mtp'] = (each depth's cross entropy [D],
    the MTP blocks' stats), layers/mtp.py."""
    moe = self.cfg.moe
    key = None if moe is None else batch_key(moe.seed, batch["inputs"])  # natural order: any sharding
    depth = self.cfg.mtp.depth if with_mtp and self.mtp is not None else 0
    if depth:
      batch = mtp_lib.shifted_fields(batch, depth)   # natural order, before any balanced move
    balanced = moe is None or moe.dispatch == "dropless"
    if balanced:  # `length` split: causal load balance
      batch = context_parallel.balance_batch(batch, ("inputs", "targets", "positions", "segment_ids", "loss_mask")
                                             + mtp_lib.all_field_names(depth))
    with context_parallel.sequence(self.cfg.context_parallel, balanced=balanced):
      x, stats = self.hidden(batch["inputs"], batch.get("positions"), batch.get("segment_ids"),
                             key=key, deterministic=deterministic)
      ce, weight, z = head_losses(self.logits, x, batch["targets"], batch.get("loss_mask"),
                                  self.cfg.loss_chunk, bool(self.cfg.z_loss))
      if depth:
        stats["mtp"] = self._mtp_losses(x, batch, key, deterministic)
    return ce, weight, z, stats

  def _mtp_losses(self, x: jax.Array, batch: dict, key, deterministic: bool) -> tuple[jax.Array, list]:
    """(the cross entropy of each MTP depth [D], each depth's block stats) from the last
    layer's output x (layers/mtp.py)."""
    positions = batch.get("positions")
    positions = default_positions(*batch["inputs"].shape) if positions is None else positions
    runs = mtp_lib.depths(self.mtp, self.cfg, self.final_norm(x), self.embed, batch, positions,
                          batch.get("segment_ids"), key, deterministic)
    ces = []
    for k, ((h, _), module) in enumerate(zip(runs, self.mtp), start=1):
      _, targets, mask = mtp_lib.field_names(k)
      ces.append(head_losses(lambda y, norm=module.head_norm: self.logits(y, norm), h, batch[targets],
                             batch[mask], self.cfg.loss_chunk)[0])
    return jnp.stack(ces), [stats for _, stats in runs]

  def loss_and_metrics(self, batch: dict) -> tuple[jax.Array, dict]:
    """The training objective and its metrics over {'inputs', 'targets'}.

    Packed batches (trainer/data/packing.py) also carry 'positions' and 'segment_ids'
    (attention stays within a document) and 'loss_mask' (0 on padding): the loss is the
    mean over unmasked tokens, and `loss_weight` (their count) lets evaluation weigh
    batches by tokens. MoE metrics are logged under 'moe/...'.
    """
    ce, weight, z, stats = self._losses(batch, deterministic=False, with_mtp=True)
    mtp_ces, mtp_stats = stats.pop("mtp", (None, []))
    loss, metrics = ce, {"loss_weight": weight}
    if z is not None:
      loss = loss + self.cfg.z_loss * z
      metrics["z_loss"] = z
    if mtp_ces is not None:   # lambda x mean over the depths (layers/mtp.py)
      loss = loss + self.cfg.mtp.loss_weight * jnp.mean(mtp_ces)
      metrics.update({f"mtp/loss_{k}": c for k, c in enumerate(mtp_ces, start=1)})
    m = self.cfg.moe
    if m is not None:
      if "expert_load" in stats:   # aux_loss_pooling='over_layers': [layers, E] shares, pooled first
        load, prob = stats.pop("expert_load"), stats.pop("expert_prob")
        stats["aux_loss"] = load.shape[-1] * jnp.sum(jnp.mean(load, 0) * jnp.mean(prob, 0))
      loss = loss + m.aux_loss_weight * stats["aux_loss"] + m.z_loss_weight * stats["z_loss"]
      terms = mtp_lib.moe_terms(mtp_stats)   # the MTP blocks' routers, at the same weights
      if terms:
        loss = loss + m.aux_loss_weight * terms["aux_loss"] + m.z_loss_weight * terms["z_loss"]
        metrics.update({"mtp/aux_loss": terms["aux_loss"], "mtp/z_loss": terms["z_loss"]})
        if "expert_buffer_overflow" in terms:
          stats["expert_buffer_overflow"] = stats["expert_buffer_overflow"] + terms["expert_buffer_overflow"]
        for k in COUNT_STATS:   # [stack's MoE layers, then the MTP depths]: trainer/moe_drops.py
          stats[k] = jnp.concatenate([stats[k], terms[k]])
      mtp_lib.set_next_biases(self.mtp or [], mtp_stats)
      next_bias = stats.pop("next_bias", None)
      metrics.update({f"moe/{k}": v.astype(jnp.float32) for k, v in stats.items()})
      if next_bias is not None:
        metrics[STATE_UPDATES] = self.balance_updates(jax.lax.stop_gradient(next_bias))
    if loss is not ce:
      metrics["ce_loss"] = ce
    return loss, metrics

  def eval_loss(self, batch: dict) -> tuple[jax.Array, dict]:
    """The validation loss and {'loss_weight'}: cross entropy alone (no z-loss or MoE
    regularizers: they are training terms, logged with the train metrics), MoE routing
    deterministic. Packed batches as in `loss_and_metrics`. An MoE model adds the copies
    each layer routed and dropped ('moe/routed_copies_count', 'moe/dropped_copies_count'),
    which evaluation reports beside the loss."""
    ce, weight, _, stats = self._losses(batch, deterministic=True)
    metrics = {"loss_weight": weight}
    if "expert_buffer_overflow" in stats:   # dropless MoE: the loop raises on it, as in training
      metrics["moe/expert_buffer_overflow"] = stats["expert_buffer_overflow"]
    metrics.update({f"moe/{k}": stats[k] for k in COUNT_STATS if k in stats})
    return ce, metrics

  def balance_updates(self, next_bias: jax.Array) -> dict:
    """The params subtree of every MoE layer's balance bias set to `next_bias` [layers, e], in
    the layout the params keep (a pipelined stack's: [S, (R,) L/(S*R), e])."""
    blocks, schedule = self.layers.blocks, self.layers.schedule
    if self.cfg.layer_pattern:
      self._pattern_balance_updates(next_bias)
    elif schedule is not None:
      blocks.moe_block.moe.balance_bias.set_value(
          pipeline.to_stages(next_bias, schedule.stages, schedule.repeats))
    elif self.cfg.scan_layers:
      blocks.moe_block.moe.balance_bias.set_value(next_bias)
    else:
      for unit, bias in zip(blocks, next_bias):
        unit.moe_block.moe.balance_bias.set_value(bias)
    return nnx.to_pure_dict(nnx.state(self, BalanceBias))

  def _pattern_balance_updates(self, next_bias: jax.Array) -> None:
    """`balance_updates` of a stack of PatternUnits: MoE layer i of the units is MoE block
    i % m of unit i // m (m per unit), the rest the tail's MoE blocks in order."""
    stack = self.layers
    m, tail = stack.unit_moe, stack.tail_moe
    units = next_bias[:next_bias.shape[0] - tail]
    units = units.reshape((-1, m) + units.shape[1:])                   # [units, m, e]
    moe_at = lambda unit: [b for b in unit.blocks if hasattr(b, "moe")]
    if isinstance(stack.blocks, nnx.List):
      for unit, biases in zip(stack.blocks, units):
        for block, bias in zip(moe_at(unit), biases):
          block.moe.balance_bias.set_value(bias)
    else:
      for i, block in enumerate(moe_at(stack.blocks)):
        bias = units[:, i]
        if stack.schedule is not None:
          bias = pipeline.to_stages(bias, stack.schedule.stages, stack.schedule.repeats)
        block.moe.balance_bias.set_value(bias)
    if stack.tail is not None:
      for block, bias in zip(moe_at(stack.tail), next_bias[next_bias.shape[0] - tail:]):
        block.moe.balance_bias.set_value(bias)


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None):
  """(mean next-token cross entropy over the targets `mask` keeps (all without one),
  float32 count of those targets, the same masked mean as a function)."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  if mask is None:
    return jnp.mean(ce), jnp.float32(ce.size), jnp.mean
  mask = mask.astype(jnp.float32)
  weight = jnp.sum(mask)
  mean = lambda v: jnp.sum(v * mask) / jnp.maximum(weight, 1.0)
  return mean(ce), weight, mean


def head_losses(logits_fn, x: jax.Array, targets: jax.Array, mask: jax.Array | None,
                chunk: int = 0, z_loss: bool = False):
  """(mean cross entropy, float32 count of the targets `mask` keeps, mean logsumexp^2 or None)
  of `logits_fn(x)` (float32 [b, l, vocab]) against targets [b, l].

  With 0 < chunk < l, the logits are made `chunk` positions at a time inside a scan whose
  body is rematerialized: the backward pass recomputes each chunk's logits instead of
  keeping [b, l, vocab] float32 alive (at Mistral-7B's 6 x 8192 tokens per chip and a 32k
  vocabulary that array is 5.86 GiB, and its bf16 gradient 2.93 GiB: docs/scale.md)."""
  b, l = targets.shape
  if not 0 < chunk < l:
    logits = logits_fn(x).astype(jnp.float32)
    ce, weight, mean = masked_cross_entropy(logits, targets, mask)
    return ce, weight, (mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))) if z_loss else None)
  if l % chunk:
    raise ValueError(f"model.loss_chunk={chunk} does not divide the sequence length {l}; "
                     f"pick a divisor of data.seq_len (or 0: the loss in one piece)")
  mask = jnp.ones((b, l), jnp.float32) if mask is None else mask.astype(jnp.float32)

  @jax.checkpoint
  def piece(start):
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1)
    logits = logits_fn(cut(x)).astype(jnp.float32)
    m = cut(mask)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, cut(targets))
    z = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * m) if z_loss else jnp.float32(0)
    return jnp.sum(ce * m), z

  def step(sums, start):
    ce, z = piece(start)
    return (sums[0] + ce, sums[1] + z), None

  (ce, z), _ = jax.lax.scan(step, (jnp.float32(0), jnp.float32(0)), jnp.arange(0, l, chunk))
  weight = jnp.sum(mask)
  count = jnp.maximum(weight, 1.0)
  return ce / count, weight, (z / count if z_loss else None)
