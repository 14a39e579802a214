"""Pre-norm Transformer block, the (scanned) layer stack, and the decoder-only LM.

Scanned layers: the L blocks are created at once by `nnx.vmap` over the constructor,
so every parameter gets a leading dim of size L (logical name 'layers'), and they are
applied by `jax.lax.scan`. XLA then compiles one block instead of L (compile time
flat in depth) and the 'layers' dim can be sharded like any other. The scan body is
`apply_layers`, a pure function of (graphdef, stacked state, x): the pipeline wrapper
runs a stage by calling it on a slice of the stacked state.

Rematerialization wraps one block in `jax.checkpoint` with the named policy:
  'none'           save everything for the backward pass (fastest, most memory)
  'full'           save only the block's input; recompute the block in the backward pass
  'dots'           save matmul outputs, recompute the cheap elementwise ops
  'dots_no_batch'  save only matmuls without batch dims (the weight projections,
                   not the attention q.k / p.v products)
  'offload'        as 'full', but the block's input (named 'decoder_layer_input') is
                   moved to host memory in the forward pass and back for the backward
                   pass: device memory for saved activations drops to ~one layer's worth
  'offload_proj'   offload the block input and the attention q/k/v and output
                   projections ('query_proj', 'key_proj', 'value_proj', 'out_proj'):
                   less recompute (no projection matmuls), more host traffic
The offload policies are jax's `save_and_offload_only_these_names` over the names
`checkpoint_name` gives in Block / Attention; the transfers are priced against the chip's
host link by trainer/perf/stepmodel.py (`offload_seconds`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardax import pipeline
from shardax.configs.schema import TransformerConfig
from shardax.layers import context_parallel
from shardax.layers.attention import Attention, default_positions, kv_cache_spec
from shardax.layers.embedding import Embed
from shardax.layers.linear import DenseGeneral
from shardax.layers.mlp import GatedMLP, PlainMLP
from shardax.layers.norm import make_norm
from shardax.sharding import shard

RESIDUAL = ("batch", "length", "embed")

LAYER_INPUT = "decoder_layer_input"
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")   # named in layers/attention.py


def _offload(*names: str):
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")


REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": _offload(LAYER_INPUT),
    "offload_proj": _offload(LAYER_INPUT, *PROJECTIONS),
}


class Block(nnx.Module):
  """x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    eps = getattr(cfg, "norm_eps", 1e-6)
    self.attn_norm = make_norm(cfg.norm, cfg.d_model, dtype=dt, param_dtype=pdt, eps=eps)
    self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head,
                          rope_theta=cfg.rope_theta, implementation=cfg.attention,
                          dtype=dt, param_dtype=pdt, qkv_bias=getattr(cfg, "qkv_bias", False),
                          out_bias=getattr(cfg, "out_bias", False), qk_norm=getattr(cfg, "qk_norm", False),
                          norm_eps=eps, rope_scaling=getattr(cfg, "rope_scaling_params", None), rngs=rngs,
                          options=cfg.attention_options(), quantization=cfg.quantization)
    # A parallel block (GPT-J/PaLM) feeds one norm to both branches: no second norm.
    self.mlp_norm = None if cfg.parallel_block else make_norm(cfg.norm, cfg.d_model, dtype=dt,
                                                              param_dtype=pdt, eps=eps)
    mlp = PlainMLP if cfg.mlp == "plain" else GatedMLP
    self.mlp = mlp(cfg.d_model, cfg.d_ff, activation=cfg.activation, dtype=dt, param_dtype=pdt,
                   use_bias=getattr(cfg, "mlp_bias", False), quantization=cfg.quantization, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array,
               segment_ids: jax.Array | None = None) -> jax.Array:
    x = checkpoint_name(shard(x, RESIDUAL), LAYER_INPUT)  # what the offload policies move to host
    if self.mlp_norm is None:
      h = self.attn_norm(x)
      return shard(x + self.attn(h, positions, segment_ids) + self.mlp(h), RESIDUAL)
    x = shard(x + self.attn(self.attn_norm(x), positions, segment_ids), RESIDUAL)
    return shard(x + self.mlp(self.mlp_norm(x)), RESIDUAL)

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """The block at decode: (x, its attention cache updated)."""
    x = shard(x, RESIDUAL)
    h = self.attn_norm(x)
    y, cache = self.attn.cached(h, positions, cache)
    if self.mlp_norm is None:  # parallel block: both branches read the same norm
      return shard(x + y + self.mlp(h), RESIDUAL), cache
    x = shard(x + y, RESIDUAL)
    return shard(x + self.mlp(self.mlp_norm(x)), RESIDUAL), cache


def block_cache_spec(cfg: TransformerConfig, batch: int, length: int) -> dict:
  """The KV cache of one block's attention (in the compute dtype)."""
  return kv_cache_spec(batch, length, cfg.kv_heads, cfg.dim_per_head, cfg.dtype)


def scan_cached(graphdef: nnx.GraphDef, stacked_state: nnx.State, x: jax.Array,
                positions: jax.Array, cache) -> tuple[jax.Array, object]:
  """Decode through stacked modules (leading dim = layers) with their stacked cache:
  one compiled layer body, the cache scanned alongside the weights."""
  def step(carry, layer):
    state, layer_cache = layer
    return nnx.merge(graphdef, state).cached(carry, positions, layer_cache)
  return jax.lax.scan(step, x, (stacked_state, cache))


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
  """`num` Blocks stacked on a leading 'layers' dim."""
  return stacked(lambda r: Block(cfg, rngs=r), num, rngs=rngs)


def block_fn(graphdef: nnx.GraphDef, remat: str = "none", *, prevent_cse: bool = True):
  """(block_state, x, positions[, segment_ids]) -> x for one block, checkpointed per `remat`.

  prevent_cse=False is right inside scan (the loop already stops XLA from merging
  the recomputation into the forward pass) and saves needless barriers.
  """
  def apply(state: nnx.State, x: jax.Array, positions: jax.Array,
            segment_ids: jax.Array | None = None) -> jax.Array:
    return nnx.merge(graphdef, state)(x, positions, segment_ids)
  if remat == "none":
    return apply
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r}: use 'none' or one of {sorted(REMAT_POLICIES)}")
  return jax.checkpoint(apply, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def apply_layers(graphdef: nnx.GraphDef, stacked_state: nnx.State, x: jax.Array,
                 positions: jax.Array | None = None, *, remat: str = "none",
                 segment_ids: jax.Array | None = None) -> jax.Array:
  """Runs the blocks in `stacked_state` (leading dim = layers) over x in order.

  `graphdef, stacked_state = nnx.split(stacked_blocks(...))`; any slice of the
  leading dim (`jax.tree.map(lambda a: a[i:j], stacked_state)`) is a valid stage.
  """
  if positions is None:
    positions = default_positions(x.shape[0], x.shape[1])
  body = block_fn(graphdef, remat, prevent_cse=False)

  def step(carry, layer_state):
    return body(layer_state, carry, positions, segment_ids), None

  x, _ = jax.lax.scan(step, x, stacked_state)
  return x


class LayerStack(nnx.Module):
  """cfg.num_layers blocks: stacked + scanned if cfg.scan_layers, else a Python list;
  with cfg.pipeline.stages > 1, stacked in the stage layout and run by `shardax.pipeline`."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.scan_layers = cfg.scan_layers
    self.remat = cfg.remat
    p = cfg.pipeline
    self.schedule = pipeline.Schedule(p.stages, p.microbatches, p.circular_repeats) if p.stages > 1 else None
    if self.schedule is not None:  # params [S, (R,) L/(S*R), ...], logical 'stage' first
      self.blocks = pipeline.restack_module(stacked_blocks(cfg, cfg.num_layers, rngs=rngs),
                                            p.stages, p.circular_repeats)
    elif cfg.scan_layers:
      self.blocks = stacked_blocks(cfg, cfg.num_layers, rngs=rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])

  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    if positions is None:
      positions = default_positions(x.shape[0], x.shape[1])
    if self.schedule is not None:  # packed rows: segment ids travel with their microbatch
      graphdef, state = nnx.split(self.blocks)
      stage = lambda w, h, pos, seg=None: apply_layers(graphdef, w, h, pos, remat=self.remat,
                                                       segment_ids=seg)
      return pipeline.run(stage, state, x, positions, self.schedule, RESIDUAL,
                          segment_ids=segment_ids)
    if self.scan_layers:
      graphdef, state = nnx.split(self.blocks)
      return apply_layers(graphdef, state, x, positions, remat=self.remat, segment_ids=segment_ids)
    for block in self.blocks:
      graphdef, state = nnx.split(block)
      x = block_fn(graphdef, self.remat)(state, x, positions, segment_ids)
    return x

  def cache_spec(self, cfg: TransformerConfig, batch: int, length: int):
    """Stacked [L, ...] cache for scanned and pipelined stacks, else one per block."""
    one = block_cache_spec(cfg, batch, length)
    if self.schedule is None and not self.scan_layers:
      return [one for _ in range(cfg.num_layers)]
    return jax.tree.map(lambda c: c.stacked(cfg.num_layers), one)

  def cached(self, x: jax.Array, positions: jax.Array, cache) -> tuple[jax.Array, object]:
    """Decode through the stack. A pipelined stack runs its stages in order, on its
    weights unstacked to [L, ...] (one token per step leaves nothing to pipeline)."""
    if self.schedule is not None:
      graphdef, state = nnx.split(self.blocks)
      state = jax.tree.map(lambda a: pipeline.from_stages(a, self.schedule.repeats), state)
      return scan_cached(graphdef, state, x, positions, cache)
    if self.scan_layers:
      return scan_cached(*nnx.split(self.blocks), x, positions, cache)
    out = []
    for block, block_cache in zip(self.blocks, cache):
      x, block_cache = block.cached(x, positions, block_cache)
      out.append(block_cache)
    return x, out


class TransformerLM(nnx.Module):
  """tokens int32[b, l] -> logits float32[b, l, vocab]: embed, blocks, norm, head."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt, pdt = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                       scale=getattr(cfg, "scale_embedding", True), rngs=rngs)
    self.layers = LayerStack(cfg, rngs=rngs)
    self.final_norm = make_norm(cfg.norm, cfg.d_model, dtype=dt, param_dtype=pdt,
                                eps=getattr(cfg, "norm_eps", 1e-6))
    self.head = None if cfg.tied_embedding else DenseGeneral(
        cfg.d_model, cfg.vocab_size, in_axes=("embed",), out_axes=("vocab",),
        dtype=dt, param_dtype=pdt, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    x = shard(self.embed(tokens), RESIDUAL)
    return self.logits(self.layers(x, positions, segment_ids))

  def cache_spec(self, batch: int, length: int):
    """Tree of `CacheSpec` (shape, dtype, logical axes) of the decode cache."""
    return self.layers.cache_spec(self.cfg, batch, length)

  def cached(self, tokens: jax.Array, positions: jax.Array, cache) -> tuple[jax.Array, object]:
    """(logits float32[b, l, vocab], cache): a prefill or a generate step (attention.py)."""
    x = shard(self.embed(tokens), RESIDUAL)
    x, cache = self.layers.cached(x, positions, cache)
    return self.logits(x), cache

  def logits(self, x: jax.Array) -> jax.Array:
    """Final norm and head (or the tied embedding): [b, l, embed] -> float32 [b, l, vocab]."""
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.head is None else self.head(x, out_dtype=jnp.float32)
    return shard(logits, ("batch", "length", "vocab"))

  def loss_and_metrics(self, batch: dict) -> tuple[jax.Array, dict]:
    """Next-token cross entropy (float32) per target token, over {'inputs', 'targets'}.

    Packed batches (trainer/data/packing.py) also carry 'positions' and 'segment_ids'
    (attention stays within a document) and 'loss_mask' (0 on padding): the loss is the
    mean over unmasked tokens, and `loss_weight` (their count) lets evaluation weigh
    batches by tokens. With cfg.z_loss set, adds z_loss x mean(logsumexp(logits)^2) over
    the same tokens (PaLM's z-loss: keeps the softmax normalizer near 1, so bf16 logits
    stay in range).
    """
    batch = context_parallel.balance_batch(batch)  # `length` split: causal load balance
    with context_parallel.sequence(self.cfg.context_parallel, balanced=True):
      logits = self(batch["inputs"], batch.get("positions"), batch.get("segment_ids")).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch.get("loss_mask")
    if mask is None:
      weight = jnp.float32(ce.size)
      mean = jnp.mean
    else:
      mask = mask.astype(jnp.float32)
      weight = jnp.sum(mask)
      mean = lambda v: jnp.sum(v * mask) / jnp.maximum(weight, 1.0)
    loss = mean(ce)
    if not self.cfg.z_loss:
      return loss, {"loss_weight": weight}
    z = mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return loss + self.cfg.z_loss * z, {"loss_weight": weight, "ce_loss": loss, "z_loss": z}
