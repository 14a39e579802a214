"""Multi-head latent attention (DeepSeek-V2/V3, arXiv 2405.04434 section 2.1), with Attention's
interface (`__call__`, `cached`) so a Block uses either.

Letters: b batch, l length, S cache slots, n heads, r kv_lora_rank, c q_lora_rank,
p qk_nope_head_dim, e qk_rope_head_dim, v v_head_dim, m embed.

    q         = up_q(norm(down_q(x)))  [b,l,n,p+e]     (or one projection: q_lora_rank=None)
    [latent, k_rope] = x W_dkv         [b,l,r+e]        one projection (transformers' kv_a_proj_with_mqa)
    latent    = norm(latent)           [b,l,r]          what every key and value comes from
    k_rope    = rope(k_rope)           [b,l,e]          one RoPE key, shared by all heads
    [k_nope, v] = latent W_ukv         [b,l,n,p+v]      per head (kv_b_proj): W_uk and W_uv side by side
    k         = [k_nope, k_rope]       [b,l,n,p+e]     no-RoPE part per head, RoPE part shared
    out       = softmax(q.k * scale) v, projected back to m
with q's last e dims rotated too and scale = (p+e)^-1/2, times YaRN's mscale^2 when the model
uses YaRN with mscale_all_dim (transformers' DeepseekV3Attention). Training runs the expanded
k, v through the attention core every other layer uses (`attend`, or context parallelism),
so its implementations, windows, soft-cap and packed segments apply unchanged; cuDNN's
fused path takes v padded to q's head size (jax.nn.dot_product_attention wants one size).

Rematerialization: the layer names its compact tensors with the projection names the remat
policies save (layers/blocks.py PROJECTIONS): 'query_proj' is the low-rank query before its
norm [b,l,c] (without q_lora_rank, the per-head query), 'key_proj' the latent and RoPE key
before their norm and rotation [b,l,r+e], 'out_proj' the output. The expanded q, k, v are
not named: a policy that keeps the projections recomputes them in the backward (the two up
projections) instead of keeping n (2 (p+e) + v) numbers per token and layer (64 K for
DeepSeek-V3, against c + r + e = 2112).

Decoding caches only `latent` [b,S,r] and the rotated `k_rope` [b,S,e] per layer (r + e
numbers per token instead of n (p+e+v): 576 against 40960 for DeepSeek-V3). A generate step
never expands them: W_uk is absorbed into the query (q_nope W_uk^T: [b,1,n,r]) and W_uv
applied after the softmax, so it is one-kv-head attention over the cached [latent, k_rope]
with the latent as the value (`cached_attention` with a single kv head). A prefill attends
within its block as training does.

The params are transformers' tensors one for one (models/hf/deepseek_v3.py). `rope_interleave`
(model.rope_interleave: DeepSeek's checkpoints) rotates pairs (0, 1), (2, 3), ... instead of
(i, i + e/2): the same rotation on the RoPE dims reordered evens-then-odds, so the layer
reorders them and rotates as everywhere else. The latent norms use eps 1e-6 whatever model.norm_eps, as transformers
builds them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardax.configs.attention import AttentionOptions
from shardax.configs.mla import MLAConfig
from shardax.configs.rope import RopeScaling
from shardax.layers import context_parallel
from shardax.layers.attention import (CacheSpec, apply_rope, attend, cached_attention, default_positions,
                                      interleaved_pairs, write_cache)
from shardax.layers.linear import DenseGeneral
from shardax.layers.norm import RMSNorm
from shardax.sharding import shard

BLNK = ("batch", "length", "heads", "kv")
LATENT_AXES = ("cache_batch", "cache_length", "kv_lora")
ROPE_KEY_AXES = ("cache_batch", "cache_length", "kv")
LATENT_NORM_EPS = 1e-6


def mla_cache_spec(batch: int, length: int, mla: MLAConfig, dtype) -> dict:
  """{'latent': [batch, length, kv_lora_rank], 'k_rope': [batch, length, qk_rope_head_dim]}."""
  dt = jnp.dtype(dtype)
  return {"latent": CacheSpec((batch, length, mla.kv_lora_rank), dt, LATENT_AXES),
          "k_rope": CacheSpec((batch, length, mla.qk_rope_head_dim), dt, ROPE_KEY_AXES)}


class MultiHeadLatentAttention(nnx.Module):
  """x[b, l, embed] -> x[b, l, embed], causal; see the module docstring."""

  @classmethod
  def from_config(cls, cfg, *, rngs: nnx.Rngs) -> "MultiHeadLatentAttention":
    """The attention of a TransformerConfig with `cfg.mla` set (what a Block builds)."""
    return cls(cfg.d_model, cfg.num_heads, cfg.mla, rope_theta=cfg.rope_theta,
               rope_scaling=cfg.rope_scaling, rope_interleave=cfg.rope_interleave, options=cfg.attention_options(),
               dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), qkv_bias=cfg.qkv_bias,
               out_bias=cfg.out_bias, quantization=cfg.quantization, rngs=rngs)

  def __init__(self, d_model: int, num_heads: int, mla: MLAConfig, *, rope_theta: float = 10_000.0,
               rope_scaling: RopeScaling | None = None, rope_interleave: bool = False,
               options: AttentionOptions | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, qkv_bias: bool = False, out_bias: bool = False,
               quantization: str = "none", rngs: nnx.Rngs):
    self.mla, self.num_heads = mla, num_heads
    self.rope_theta = rope_theta
    self.rope_scaling, self.rope_interleave = rope_scaling, rope_interleave
    self.options = options or AttentionOptions()
    # softmax scale = mscale / sqrt(p + e): YaRN's mscale(factor, mscale_all_dim)^2 (transformers'
    # yarn_apply_mscale), 1 for other RoPE.
    self.mscale = 1.0 if rope_scaling is None else rope_scaling.softmax_mscale
    self.dtype = dtype
    n, p, e, r = num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    kw = dict(dtype=dtype, param_dtype=param_dtype, quantization=quantization, rngs=rngs)
    norm = lambda size, axis: RMSNorm(size, eps=LATENT_NORM_EPS, dtype=dtype, param_dtype=param_dtype,
                                      axis_name=axis)
    if mla.q_lora_rank is None:
      self.query = DenseGeneral(d_model, (n, p + e), in_axes=("embed",), out_axes=("heads", "kv"), **kw)
      self.q_down = self.q_norm = self.q_up = None
    else:
      c = mla.q_lora_rank
      self.query = None
      self.q_down = DenseGeneral(d_model, c, in_axes=("embed",), out_axes=("q_lora",), use_bias=qkv_bias, **kw)
      self.q_norm = norm(c, "q_lora")
      self.q_up = DenseGeneral(c, (n, p + e), in_axes=("q_lora",), out_axes=("heads", "kv"), **kw)
    self.kv_down = DenseGeneral(d_model, r + e, in_axes=("embed",), out_axes=("kv_lora",), use_bias=qkv_bias,
                                **kw)
    self.kv_norm = norm(r, "kv_lora")
    self.kv_up = DenseGeneral(r, (n, p + mla.v_head_dim), in_axes=("kv_lora",), out_axes=("heads", "kv"), **kw)
    self.out = DenseGeneral((n, mla.v_head_dim), d_model, in_axes=("heads", "kv"), out_axes=("embed",),
                            use_bias=out_bias, **kw)

  def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    if self.rope_interleave:   # pairs (0, 1), (2, 3), ...: rotate-half of evens-then-odds
      x = interleaved_pairs(x)
    return apply_rope(x, positions, self.rope_theta, self.rope_scaling)

  def _queries(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(q_nope [b,l,n,p], q_rope [b,l,n,e] rotated)."""
    if self.query is not None:   # one projection: the per-head query is what remat may keep
      q = checkpoint_name(self.query(x), "query_proj")
    else:                        # the low-rank query is kept, its up projection recomputed
      q = self.q_up(self.q_norm(checkpoint_name(self.q_down(x), "query_proj")))
    q = shard(q, BLNK)
    p = self.mla.qk_nope_head_dim
    return q[..., :p], self._rope(q[..., p:], positions)

  def _latents(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(latent [b,l,r] normalized, k_rope [b,l,e] rotated)."""
    down, r = checkpoint_name(self.kv_down(x), "key_proj"), self.mla.kv_lora_rank
    latent = shard(self.kv_norm(down[..., :r]), ("batch", "length", "kv_lora"))
    k_rope = self._rope(down[:, :, None, r:], positions)[:, :, 0]
    return latent, shard(k_rope, ("batch", "length", "kv"))

  def _expanded(self, q_nope, q_rope, latent, k_rope) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Full-width q, k [b,l,n,p+e] and v [b,l,n,v]; q carries the part of the softmax scale
    the core's (p+e)^-1/2 does not apply (YaRN's mscale^2)."""
    kv = shard(self.kv_up(latent), BLNK)
    k_nope, v = kv[..., :self.mla.qk_nope_head_dim], kv[..., self.mla.qk_nope_head_dim:]
    k_rope = jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype), k_nope.shape[:-1] + k_rope.shape[-1:])
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
    if self.mscale != 1.0:
      q = q * jnp.asarray(self.mscale, q.dtype)
    k = jnp.concatenate([k_nope, k_rope], axis=-1)
    return shard(q, BLNK), shard(k, BLNK), shard(v, BLNK)

  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    if positions is None:
      positions = default_positions(x.shape[0], x.shape[1])
    q, k, v = self._expanded(*self._queries(x, positions), *self._latents(x, positions))
    split = context_parallel.length_split()  # `length` on a mesh axis: context parallel
    if split is not None:
      o = context_parallel.attention(q, k, v, segment_ids, split, options=self.options)
    else:
      o = attend(q, k, v, segment_ids, options=self.options)
    return checkpoint_name(self.out(shard(o, BLNK)), "out_proj")

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """(out, cache with this block's latent and RoPE key written): a prefill (x[b, l > 1],
    positions 0..l-1) or one generate step (x[b, 1] at positions[b, 0]), as Attention.cached."""
    q_nope, q_rope = self._queries(x, positions)
    latent, k_rope = self._latents(x, positions)
    cache = {"latent": shard(write_cache(cache["latent"], latent, positions), LATENT_AXES),
             "k_rope": shard(write_cache(cache["k_rope"], k_rope, positions), ROPE_KEY_AXES)}
    if x.shape[1] > 1:  # prefill: the block's own keys are all it may see (causal from 0)
      o = attend(*self._expanded(q_nope, q_rope, latent, k_rope), options=self.options)
      return self.out(shard(o, BLNK)), cache
    # Generate step: W_uk absorbed into the query, the latent is the one kv head's value.
    dt = self.dtype
    w_uk, w_uv = jnp.split(self.kv_up.kernel[...].astype(dt), [self.mla.qk_nope_head_dim], axis=-1)
    q_latent = jnp.einsum("blnp,rnp->blnr", q_nope, w_uk)
    q = jnp.concatenate([q_latent, q_rope.astype(dt)], axis=-1)
    # cached_attention scales by (r + e)^-1/2; the softmax wants mscale (p + e)^-1/2.
    q = q * jnp.asarray(self.mscale * (q.shape[-1] / self.mla.qk_head_dim) ** 0.5, dt)
    q = shard(q, BLNK)
    keys = jnp.concatenate([cache["latent"], cache["k_rope"]], axis=-1)[:, :, None, :]
    o_latent = cached_attention(q, keys.astype(dt), cache["latent"][:, :, None, :].astype(dt), positions,
                                window=self.options.window, softcap=self.options.softcap)
    o = jnp.einsum("blnr,rnv->blnv", o_latent, w_uv)
    return self.out(shard(o, BLNK)), cache
