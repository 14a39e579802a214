"""The decoder's layers: one Block (attention, then a dense MLP or an MoE FFN), the repeating
unit of the stack, and how units are stacked, rematerialized and scanned.

One block class serves dense and MoE models (as torchtitan's DeepSeek-V3/Llama 4 blocks and
Hugging Face's MoE models do): the layer's index decides whether its feed-forward is the
dense MLP or `MoEFeedForward`, so every attention, norm, parallel-block, quantization and
remat option reaches MoE layers by construction.

The stack repeats a *unit*: for a dense model one Block; for an MoE model (`cfg.moe`)
`moe.every - 1` dense Blocks then one MoE Block (GShard's every-other-layer is every=2,
Mixtral every=1). An MoE model's first `moe.first_dense_layers` layers (DeepSeek-V3: 3) are
dense Blocks before the units. Every unit returns (x, stats): the MoE block's gating
statistics (balance and z losses, load metrics, the next balance bias), empty for dense.

Per-layer attention kinds (`cfg.layer_pattern`, configs/attention.py LayerKind: a window or a
chunk, RoPE on/off and its base, temperature tuning): layer i has kind i % len(pattern), each
Block built with its kind's static options (so a kernel or the decode cache sees a static
mask). The unit is then a `PatternUnit` of lcm(len(pattern), moe.every) Blocks, one kind and
feed-forward each, and its statistics are stacked per MoE Block ([MoE blocks of the unit, ...]).
Layers after the last whole unit (Gemma 3: 26 layers, a pattern of 6) form one more
`PatternUnit`, the tail, run once after the scanned units: its blocks have different kinds, so
no one scan body serves them, and being shorter than a unit it compiles no more than one unit.

Scanned layers: the units are created at once by `nnx.vmap` over the constructor, so every
parameter gets a leading dim (logical name 'layers'), and they are applied by
`jax.lax.scan`: XLA compiles one unit instead of L (compile time flat in depth), and the
'layers' dim can be sharded like any other. The pipeline runs a stage by calling
`scan_units` on a slice of the stacked state (its units' statistics come back per layer).

Rematerialization wraps one unit in `jax.checkpoint` with the named policy:
  'none'           save everything for the backward pass (fastest, most memory)
  'full'           save only the unit's input; recompute the unit in the backward pass
  'dots'           save matmul outputs, recompute the cheap elementwise ops
  'dots_no_batch'  save only matmuls without batch dims (the weight projections,
                   not the attention q.k / p.v products)
  'offload'        as 'full', but the block input (named 'decoder_layer_input') is
                   moved to host memory in the forward pass and back for the backward
                   pass: device memory for saved activations drops to ~one layer's worth
  'offload_proj'   offload the block input and the attention q/k/v and output
                   projections ('query_proj', 'key_proj', 'value_proj', 'out_proj'):
                   less recompute (no projection matmuls), more host traffic
  'offload_qkv'    offload the block input and q/k/v, recompute the out projection:
                   MaxText's custom policy in its Llama-3.1-70B 8k v6e recipe (a quarter
                   less host traffic a layer than 'offload_proj' for one small matmul more)
  'moe_matmuls'    save (on device) the attention projections and every expert matmul's
                   output ('expert_matmul', 'expert_down': layers/moe_dispatch.py), recompute the rest:
                   for MoE layers whose grouped matmuls are Pallas kernels (megablox),
                   which 'dots' does not see as dots and recomputes (on a dense model:
                   the projections only; inside a pipeline stage as none: pipeline/loop.py)
  'moe_returned'   save the attention projections, the expert gate/up outputs and the
                   expert outputs back on the token side ('expert_returned'), not the
                   down projection's: the backward recomputes the dispatch exchange (its
                   rows feed the gate/up weight gradients) and elementwise work, but no
                   expert matmul and not the return exchange. For fine-grained experts
                   over a padded receive buffer, whose down outputs are twice the returned
                   ones (DeepSeek-V3: 940 against 470 MB a layer per chip)
The offload policies are jax's `save_and_offload_only_these_names` over the names
`checkpoint_name` gives in Block / Attention; the transfers are priced against the chip's
host link by perf/stepmodel.py (`offload_seconds`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardax.configs.attention import LayerKind
from shardax.configs.schema import TransformerConfig
from shardax.layers.attention import Attention, default_positions, kv_cache_spec
from shardax.layers.mla import MultiHeadLatentAttention, mla_cache_spec
from shardax.layers.mlp import GatedMLP, PlainMLP
from shardax.layers.moe import MoEFeedForward
from shardax.layers.moe_dispatch import EXPERT_DOWN, EXPERT_MATMUL, EXPERT_RETURNED
from shardax.layers.norm import make_norm
from shardax.sharding import shard

RESIDUAL = ("batch", "length", "embed")

LAYER_INPUT = "decoder_layer_input"
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")   # named in layers/attention.py


def _offload(*names: str):
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")


# What each offload policy moves to host memory: one table for the policies below and for
# readers of another framework's per-tensor policy (experiments/calibration.py: MaxText's custom).
OFFLOADED = {"offload": (LAYER_INPUT,), "offload_qkv": (LAYER_INPUT, *PROJECTIONS[:3]),
             "offload_proj": (LAYER_INPUT, *PROJECTIONS)}

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    **{policy: _offload(*names) for policy, names in OFFLOADED.items()},
    "moe_matmuls": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS, EXPERT_MATMUL, EXPERT_DOWN),
    "moe_returned": jax.checkpoint_policies.save_only_these_names(*PROJECTIONS, EXPERT_MATMUL, EXPERT_RETURNED),
}


class Block(nnx.Module):
  """x + attn(norm(x)), then x + ffn(norm(x)); ffn = the dense MLP, or the MoE FFN (`moe=True`,
  attribute `moe`). A parallel block (GPT-J/PaLM) adds both branches of one norm.
  `cfg.post_norms` (Gemma 2/3) normalizes each branch's output too before it is added:
  x + post_norm(attn(norm(x))), params `attn_post_norm` and `mlp_post_norm`."""

  def __init__(self, cfg: TransformerConfig, *, moe: bool = False, kind: LayerKind | None = None,
               rngs: nnx.Rngs):
    """`kind`: this layer's attention kind (a `cfg.layer_pattern` entry); None = the model's
    uniform attention fields."""
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    eps = cfg.norm_eps
    self.attn_norm = make_norm(cfg.norm, cfg.d_model, dtype=dt, param_dtype=pdt, eps=eps)
    if cfg.mla is not None:   # multi-head latent attention (layers/mla.py)
      self.attn = MultiHeadLatentAttention.from_config(cfg, rngs=rngs)
    else:
      self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head,
                            implementation=cfg.attention,
                            dtype=dt, param_dtype=pdt, qkv_bias=cfg.qkv_bias, out_bias=cfg.out_bias,
                            qk_norm=cfg.qk_norm, norm_eps=eps, norm_plus_one=cfg.norm == "rms_plus_one",
                            softmax_scale=cfg.softmax_scale, rngs=rngs, options=cfg.attention_options(kind),
                            quantization=cfg.quantization, rope_interleave=cfg.rope_interleave,
                            qk_l2_norm=cfg.qk_l2_norm, **kind_options(cfg, kind))
    self.mlp_norm = None if cfg.parallel_block else make_norm(cfg.norm, cfg.d_model, dtype=dt,
                                                              param_dtype=pdt, eps=eps)
    post = lambda: make_norm(cfg.norm, cfg.d_model, dtype=dt, param_dtype=pdt, eps=eps) if cfg.post_norms else None
    self.attn_post_norm, self.mlp_post_norm = post(), post()   # parallel blocks refuse post_norms (schema)
    if moe:
      self.moe = MoEFeedForward(cfg.d_model, cfg.moe, activation=cfg.activation, dtype=dt,
                                param_dtype=pdt, quantization=cfg.quantization, rngs=rngs)
    else:
      mlp = PlainMLP if cfg.mlp == "plain" else GatedMLP
      self.mlp = mlp(cfg.d_model, cfg.d_ff, activation=cfg.activation, dtype=dt, param_dtype=pdt,
                     use_bias=cfg.mlp_bias, quantization=cfg.quantization, rngs=rngs)

  def ffn(self, h: jax.Array, key: jax.Array | None = None,
          deterministic: bool = False) -> tuple[jax.Array, dict]:
    """(ffn(h), gating stats: {} for the dense MLP)."""
    if hasattr(self, "moe"):
      return self.moe(h, key, deterministic)
    return self.mlp(h), {}

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               key: jax.Array | None = None, deterministic: bool = False) -> tuple[jax.Array, dict]:
    x = checkpoint_name(shard(x, RESIDUAL), LAYER_INPUT)  # what the offload policies move to host
    if self.mlp_norm is None:
      h = self.attn_norm(x)
      y, stats = self.ffn(h, key, deterministic)
      return shard(x + self.attn(h, positions, segment_ids) + y, RESIDUAL), stats
    y = _post(self.attn_post_norm, self.attn(self.attn_norm(x), positions, segment_ids))
    x = shard(x + y, RESIDUAL)
    y, stats = self.ffn(self.mlp_norm(x), key, deterministic)
    return shard(x + _post(self.mlp_post_norm, y), RESIDUAL), stats

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict
             ) -> tuple[jax.Array, dict, jax.Array]:
    """The block at decode: (x, its attention cache updated, `dropped`: float32, the token
    copies its MoE FFN routed to an expert that gave them no output; 0 for a dense block).

    Decoding builds the model from `TransformerConfig.for_decode`, where every dispatch runs
    at its no-overflow bound, so `dropped` is 0 by construction; it is returned rather than
    discarded so that a dispatch forced below the bound fails by name (trainer/decode.py),
    where its poisoned (NaN) logits would otherwise be argmaxed into tokens."""
    x = shard(x, RESIDUAL)
    h = self.attn_norm(x)
    y, cache = self.attn.cached(h, positions, cache)
    if self.mlp_norm is None:  # parallel block: both branches read the same norm
      f, dropped = self._decode_ffn(h)
      return shard(x + y + f, RESIDUAL), cache, dropped
    x = shard(x + _post(self.attn_post_norm, y), RESIDUAL)
    f, dropped = self._decode_ffn(self.mlp_norm(x))
    return shard(x + _post(self.mlp_post_norm, f), RESIDUAL), cache, dropped

  def _decode_ffn(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ffn(h) with deterministic routing, the copies it dropped: `copies_without_output`)."""
    y, stats = self.ffn(h, deterministic=True)
    return y, copies_without_output(stats)


def _post(norm, y: jax.Array) -> jax.Array:
  """A branch's output through its post-norm (`cfg.post_norms`), or as it is."""
  return y if norm is None else norm(y)


def kind_options(cfg: TransformerConfig, kind: LayerKind | None) -> dict:
  """The Attention arguments a layer kind sets besides its mask: its RoPE base and scaling,
  RoPE on/off and the query temperature (for None: the model's uniform RoPE)."""
  if kind is None:
    return {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling}
  temperature = (cfg.temperature_floor_scale, cfg.temperature_scale) if kind.temperature_tuning else None
  theta = cfg.rope_theta if kind.rope_theta is None else kind.rope_theta
  scaling = cfg.rope_scaling if kind.rope_scaled else None
  return {"rope_theta": theta, "rope_scaling": scaling, "rope": kind.rope, "temperature": temperature}


def copies_without_output(stats: dict) -> jax.Array:
  """float32: the token copies an MoE FFN call routed to an expert and got no output for,
  from its stats: those dropped (capacity, or a dropless buffer with expert_overflow='drop')
  plus those past a dropless buffer with 'error' (whose output is NaN). 0 without MoE."""
  count = jnp.zeros((), jnp.float32)
  for key in ("dropped_copies_count", "expert_buffer_overflow"):
    if key in stats:
      count = count + jnp.sum(stats[key]).astype(jnp.float32)
  return count


class Unit(nnx.Module):
  """An MoE model's repeating unit: (moe.every - 1) dense Blocks, then one MoE Block."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.dense = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.moe.every - 1)])
    self.moe_block = Block(cfg, moe=True, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               key: jax.Array | None = None, deterministic: bool = False) -> tuple[jax.Array, dict]:
    for block in self.dense:
      x, _ = block(x, positions, segment_ids)
    return self.moe_block(x, positions, segment_ids, key, deterministic)

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict
             ) -> tuple[jax.Array, dict, jax.Array]:
    """As `Block.cached`; `dropped` is the MoE block's (the dense blocks drop nothing)."""
    dense = []
    for block, block_cache in zip(self.dense, cache["dense"]):
      x, block_cache, _ = block.cached(x, positions, block_cache)
      dense.append(block_cache)
    x, moe_cache, dropped = self.moe_block.cached(x, positions, cache["moe"])
    return x, {"dense": dense, "moe": moe_cache}, dropped


def is_moe_layer(cfg: TransformerConfig, layer: int) -> bool:
  """Whether 0-based layer `layer` (counted after the first dense layers) has the MoE FFN."""
  return cfg.moe is not None and (layer + 1) % cfg.moe.every == 0


class PatternUnit(nnx.Module):
  """Blocks of a model with a layer pattern: `count` layers from layer `start` (counted after
  the first dense layers), each with its kind and its feed-forward (dense, or MoE every
  moe.every layers). The stack's unit (start 0, `cfg.layers_per_unit` layers) or its tail.
  Returns (x, stats stacked [MoE blocks, ...]; {} without MoE blocks); `keys` [MoE blocks]."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, start: int = 0,
               count: int | None = None):
    count = cfg.layers_per_unit if count is None else count
    self.blocks = nnx.List([Block(cfg, moe=is_moe_layer(cfg, i), kind=cfg.layer_kind(i), rngs=rngs)
                            for i in range(start, start + count)])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None,
               keys: jax.Array | None = None, deterministic: bool = False) -> tuple[jax.Array, dict]:
    stats = []
    for block in self.blocks:
      if hasattr(block, "moe"):
        key = None if keys is None else keys[len(stats)]
        x, s = block(x, positions, segment_ids, key, deterministic)
        stats.append(s)
      else:
        x, _ = block(x, positions, segment_ids)
    return x, (jax.tree.map(lambda *v: jnp.stack(v), *stats) if stats else {})

  def cached(self, x: jax.Array, positions: jax.Array, cache: list
             ) -> tuple[jax.Array, list, jax.Array]:
    """As `Block.cached`, `dropped` float32 [MoE blocks] (a dense model's: [blocks], zeros)."""
    out, dropped = [], []
    moe = any(hasattr(b, "moe") for b in self.blocks)
    for block, block_cache in zip(self.blocks, cache):
      x, block_cache, d = block.cached(x, positions, block_cache)
      out.append(block_cache)
      if hasattr(block, "moe") or not moe:
        dropped.append(d)
    return x, out, jnp.stack(dropped)


def make_unit(cfg: TransformerConfig, rngs: nnx.Rngs) -> Block | Unit | PatternUnit:
  """The stack's repeating unit: a Block (dense model), a Unit (MoE model), a PatternUnit
  (a model with a layer pattern)."""
  if cfg.layer_pattern:
    return PatternUnit(cfg, rngs=rngs)
  return Block(cfg, rngs=rngs) if cfg.moe is None else Unit(cfg, rngs=rngs)


def block_cache_spec(cfg: TransformerConfig, batch: int, length: int, kind: LayerKind | None = None,
                     bounded: bool = True) -> dict:
  """The decode cache of one Block of attention `kind` (None: the model's uniform fields): its
  attention's KV cache, a ring of window (or chunk) slots when that is below `length` and
  `bounded` (layers/attention.py `kv_cache_spec`), or MLA's latent and RoPE key; in the
  compute dtype."""
  if cfg.mla is not None:
    return mla_cache_spec(batch, length, cfg.mla, cfg.dtype)
  options = cfg.attention_options(kind)
  span = (options.window or options.chunk) if bounded else None
  return kv_cache_spec(batch, length, cfg.kv_heads, cfg.dim_per_head, cfg.dtype, span)


def unit_cache_spec(cfg: TransformerConfig, batch: int, length: int, bounded: bool = True):
  """The decode cache of one unit: a Block's, {'dense': [...], 'moe': ...}, or a
  PatternUnit's list of its blocks' caches, each its kind's (so stacking units stacks each
  kind's cache with its own length)."""
  if cfg.layer_pattern:
    return [block_cache_spec(cfg, batch, length, cfg.layer_kind(i), bounded)
            for i in range(cfg.layers_per_unit)]
  one = block_cache_spec(cfg, batch, length, bounded=bounded)
  return one if cfg.moe is None else {"dense": [one] * (cfg.moe.every - 1), "moe": one}


def stacked(make_one: Callable[[nnx.Rngs], nnx.Module], num: int, *, rngs: nnx.Rngs) -> nnx.Module:
  """One module whose params have a leading dim `num`, logical name 'layers' prepended.

  Each layer gets its own init key (split_rngs); nnx.vmap does not know our
  `logical_axes` metadata, so the leading name is added here.
  """
  @nnx.split_rngs(splits=num)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(r: nnx.Rngs) -> nnx.Module:
    return make_one(r)

  module = make(rngs)
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Variable) and hasattr(node, "logical_axes"):
      node.set_metadata(logical_axes=("layers",) + tuple(node.logical_axes))
  return module


def stacked_blocks(cfg: TransformerConfig, num: int, *, rngs: nnx.Rngs) -> Block:
  """`num` dense Blocks stacked on a leading 'layers' dim."""
  return stacked(lambda r: Block(cfg, rngs=r), num, rngs=rngs)


def block_fn(graphdef: nnx.GraphDef, remat: str = "none", *, prevent_cse: bool = True,
             deterministic: bool = False):
  """(state, x, positions, segment_ids=None, key=None) -> (x, stats) for one unit (or
  Block), checkpointed per `remat`.

  prevent_cse=False is right inside scan (the loop already stops XLA from merging
  the recomputation into the forward pass) and saves needless barriers.
  """
  def apply(state: nnx.State, x: jax.Array, positions: jax.Array,
            segment_ids: jax.Array | None = None, key: jax.Array | None = None):
    return nnx.merge(graphdef, state)(x, positions, segment_ids, key, deterministic)
  if remat == "none":
    return apply
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r}: use 'none' or one of {sorted(REMAT_POLICIES)}")
  return jax.checkpoint(apply, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def scan_units(graphdef: nnx.GraphDef, stacked_state: nnx.State, x: jax.Array,
               positions: jax.Array, *, remat: str = "none", segment_ids: jax.Array | None = None,
               keys: jax.Array | None = None, deterministic: bool = False) -> tuple[jax.Array, dict]:
  """Runs the units in `stacked_state` (leading dim = layers) over x in order:
  (x, stats stacked on a leading layers dim). `keys`: one gating key per unit (MoE)."""
  body = block_fn(graphdef, remat, prevent_cse=False, deterministic=deterministic)

  def step(carry, xs):
    state, key = xs
    return body(state, carry, positions, segment_ids, key)

  return jax.lax.scan(step, x, (stacked_state, keys))


def apply_layers(graphdef: nnx.GraphDef, stacked_state: nnx.State, x: jax.Array,
                 positions: jax.Array | None = None, *, remat: str = "none",
                 segment_ids: jax.Array | None = None) -> jax.Array:
  """Runs the dense blocks in `stacked_state` (leading dim = layers) over x in order.

  `graphdef, stacked_state = nnx.split(stacked_blocks(...))`; any slice of the
  leading dim (`jax.tree.map(lambda a: a[i:j], stacked_state)`) is a valid stage.
  """
  if positions is None:
    positions = default_positions(x.shape[0], x.shape[1])
  return scan_units(graphdef, stacked_state, x, positions, remat=remat, segment_ids=segment_ids)[0]


def scan_cached(graphdef: nnx.GraphDef, stacked_state: nnx.State, x: jax.Array,
                positions: jax.Array, cache) -> tuple[jax.Array, object, jax.Array]:
  """Decode through stacked units (leading dim = layers) with their stacked cache:
  one compiled layer body, the cache scanned alongside the weights. Returns (x, the cache,
  each unit's dropped copies [layers]: `Block.cached`)."""
  def step(carry, layer):
    state, layer_cache = layer
    x, layer_cache, dropped = nnx.merge(graphdef, state).cached(carry, positions, layer_cache)
    return x, (layer_cache, dropped)
  x, (cache, dropped) = jax.lax.scan(step, x, (stacked_state, cache))
  return x, cache, dropped
