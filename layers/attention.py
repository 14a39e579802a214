"""Causal self-attention: multi-head and grouped-query, rotary positions.

Shapes (Praxis-style letters): b batch, l/q query length, s key length, n query heads,
k kv heads, g = n // k query heads per kv head, d head dim (logical name 'kv').

Grouped-query attention reshapes the n query heads into (k, g) and contracts each
group against its own kv head, so k/v are never repeated in memory; with k = n it is
ordinary multi-head attention. Query head h uses kv head h // g, the same grouping
`jax.nn.dot_product_attention` uses, so the two paths below agree:

  'xla'    explicit einsums, float32 logits and softmax, causal mask by index;
  'fused'  `jax.nn.dot_product_attention(..., is_causal=True)`, which XLA/cuDNN may
           lower to a flash-attention kernel;
  'flash'  the Pallas splash kernel (layers/flash.py), run per device under shard_map;
  'auto'   'flash' when compiling for a TPU (a real one or a dry run's topology) and
           the lengths suit the kernel, 'fused' on a GPU, 'xla' elsewhere.
All of them go through `attention_core` (one device's arrays) / `attend` (global arrays),
with the options of `AttentionOptions`: a sliding window and a logit soft-cap, the same
on every path. Chunked local attention (query i sees keys j <= i of its own chunk of C
tokens: Llama 4) is folded into the batch (`chunked`): [b, l] -> [b * l/C, C], then plain
causal attention on any path, so the flash kernel and cuDNN keep their static causal mask
and no [l, l] mask is ever built. Context parallelism refuses it by name.

Per layer (`TransformerConfig.layer_pattern`, configs/attention.py LayerKind) a layer may
also skip RoPE (NoPE) or use its own base, and scale q by Llama 4's temperature
log(floor((pos + 1) / floor_scale) + 1) * scale + 1 (`query_temperature`).

Attention sinks (gpt-oss, `AttentionOptions.sinks`, param `sinks` [heads]): each query head's
softmax has one more logit, its sink, in the denominator and no value (attention_scores.py
`masked_output`): on the XLA path, the decode cache and context parallelism; the splash kernel
and jax.nn.dot_product_attention have none ('auto' picks 'xla'; 'flash' / 'fused' are refused).

Positions only rotate q and k (RoPE); the causal mask is by sequence index, so a
shifted `positions` (e.g. a decode offset) changes nothing but the rotation.

Packed documents: with `segment_ids[b, l]` (1, 2, ... per document in a row, 0 for
padding) a query attends only to keys of its own segment, on both paths: the causal
mask and the segment mask are combined, so attention never crosses a document boundary.

Decoding (`Attention.cached`) keeps a KV cache per layer, logical axes (`cache_batch`,
`cache_length`, `kv_heads`, `kv`), so the rules split it like any tensor (batch over data, kv
heads over model). Prompts are right-padded; a prefill's positions are 0..l-1 on a row's
prompt tokens and -1 on its padding (trainer/decode_cache.py). Two layouts (`kv_cache_spec`):
  full   {'k', 'v'}: [b, S, k, d], S = the decode length; slot j holds position j. Prefill
         writes slots 0..l-1 (padding too: those slots are rewritten before any query sees
         them); a generate step (l = 1) writes each row's slot `positions[b]` and attends to
         the slots j <= positions[b] (and its window or chunk).
  ring   {'k', 'v', 'held'}: [b, R, k, d] with R = the layer's window w (or chunk c) < S, and
         held[b, s] = 1 + the position slot s holds (0 = empty, so a zero cache is an empty
         one). A layer that never looks more than R - 1 positions back needs only the last R:
         position p lives in slot p mod R. Prefill keeps each row's last R prompt positions;
         a generate step overwrites the slot of the position R back and attends to the held
         positions its mask admits. Memory per layer is bounded by w (or c), not by S.
A prefill's own attention runs over the block's fresh keys (causal from 0), never the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardax.configs.attention import IMPLEMENTATIONS, AttentionOptions  # noqa: F401  (re-exported)
from shardax.configs.rope import RopeScaling
from shardax.layers import context_parallel, flash
from shardax.layers.rope import rope_inv_freq
from shardax.layers.attention_choice import resolve  # noqa: F401  (re-exported)
from shardax.layers.attention_scores import grouped_logits, masked_output
from shardax.layers.linear import DenseGeneral
from shardax.layers.norm import RMSNorm
from shardax.sharding import shard
from shardax.sharding.target import target_platform


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10_000.0,
               scaling: RopeScaling | None = None) -> jax.Array:
  """Rotary embedding (rotate-half form) of x[b, l, heads, d] at positions[b, l].

  Pair (x_i, x_{i+d/2}) is rotated by angle pos * theta^(-2i/d); a dot product of two
  rotated vectors then depends on their positions only through the difference.
  Computed in float32 (angles of large positions need the mantissa), cast back.
  `scaling`: the frequencies' scaling (layers/rope.py; YaRN also scales cos and sin by its
  `cos_sin_scale`), None for plain RoPE.
  """
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"RoPE needs an even head dim, got {d}")
  inv_freq = rope_inv_freq(d, theta, scaling)
  angle = positions.astype(jnp.float32)[..., None] * inv_freq     # [b, l, d/2]
  sin = jnp.sin(angle)[..., None, :]                                # [b, l, 1, d/2]
  cos = jnp.cos(angle)[..., None, :]
  if scaling is not None and scaling.cos_sin_scale != 1.0:
    sin, cos = sin * scaling.cos_sin_scale, cos * scaling.cos_sin_scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """bool[b, l, l]: query i may see key j of the same segment (document) only."""
  return segment_ids[:, :, None] == segment_ids[:, None, :]


def query_temperature(positions: jax.Array, floor_scale: float, scale: float) -> jax.Array:
  """float32[b, l, 1, 1]: Llama 4's attention temperature of the query at each position,
  log(floor((pos + 1) / floor_scale) + 1) * scale + 1 (1 below floor_scale - 1), which
  sharpens NoPE layers' attention as the context grows (arXiv 2501.19399)."""
  pos = positions.astype(jnp.float32)
  t = jnp.log1p(jnp.floor((pos + 1.0) / jnp.float32(floor_scale))) * jnp.float32(scale) + 1.0
  return t[..., None, None]


def interleaved_pairs(x: jax.Array) -> jax.Array:
  """x[..., d] with the even dims first, then the odd ones: rotate-half RoPE of the result
  rotates the pairs (0, 1), (2, 3), ... of x (Llama 4's complex-number RoPE, DeepSeek's
  interleave). Applied to q and k alike it leaves their dot products as the model defines them."""
  return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def unit_rms(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last dim, in float32, cast back (Llama 4's weightless
  q/k norm)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)).astype(x.dtype)


def chunked(attend_fn, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
            chunk: int) -> jax.Array:
  """Chunked causal attention: query i sees key j iff j <= i and j // chunk == i // chunk.

  The sequence is padded to a multiple of `chunk` and folded into the batch,
  q[b, l] -> [b * l/chunk, chunk], so `attend_fn(q, k, v, segment_ids)` (any causal path)
  runs each chunk on its own; padded keys sit after every real query (causally unseen)."""
  b, l = q.shape[:2]
  if k.shape[1] != l:
    raise ValueError(f"chunked attention (a layer kind's chunk={chunk}) needs queries and keys of "
                     f"one sequence, got q {l} / kv {k.shape[1]}")
  if l <= chunk:
    return attend_fn(q, k, v, segment_ids)
  pad = -l % chunk
  n = (l + pad) // chunk

  def fold(x):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((b * n, chunk) + x.shape[2:])

  seg = None if segment_ids is None else fold(segment_ids)
  q2, k2, v2 = (shard(fold(t), ("batch", "length", h, "kv"))
                for t, h in ((q, "heads"), (k, "kv_heads"), (v, "kv_heads")))
  out = attend_fn(q2, k2, v2, seg)
  return out.reshape((b, n * chunk) + out.shape[2:])[:, :l]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                  segment_ids: jax.Array | None = None, *, window: int | None = None,
                  softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
  """Causal GQA by einsums: q[b,l,n,d], k/v[b,s,k,d] -> [b,l,n,d]; within segments if given;
  within a sliding `window` (key j visible to query i iff i - window < j <= i) and with
  logits soft-capped (cap * tanh(logits / cap), after the 1/sqrt(d) scale) when set."""
  l = q.shape[1]
  logits = grouped_logits(q, k, softcap)
  mask = jnp.tril(jnp.ones((l, k.shape[1]), dtype=bool))[None]     # [1|b, q, s]
  if window is not None:
    mask = mask & ~jnp.tril(jnp.ones((l, k.shape[1]), dtype=bool), -window)[None]
  if segment_ids is not None:
    mask = mask & segment_mask(segment_ids)
  return masked_output(logits, mask[:, None, None], v, sinks)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    segment_ids: jax.Array | None = None, *, window: int | None = None) -> jax.Array:
  """Causal GQA via jax.nn.dot_product_attention (same layout and grouping).

  On a GPU it asks for cuDNN's flash attention where cuDNN takes the shapes: jax's default
  (implementation=None) is XLA's unfused softmax, which keeps [batch, heads, q, kv] scores for
  the backward pass: lm.1b at batch 8 asked an H100 for 135 GiB and failed.

  Packed documents still need the dense [b, 1, l, l] segment mask here: jax 0.10.2's public
  signature has `query_seq_lengths` / `key_value_seq_lengths` (one valid prefix per row:
  right-padding, not several documents) and no segment ids. cuDNN's packed layout (several
  segments per row, via per-row segment lengths and offsets) exists only in jax's private
  `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(q_seqlen=[b, max_segs],
  q_offsets=...)`, needs sm90+ and a static maximum segment count per row; not used."""
  mask = None if segment_ids is None else segment_mask(segment_ids)[:, None]  # [b, 1, q, s]
  local = None if window is None else (window - 1, 0)
  dv = v.shape[-1]   # one head size for q, k and v here: a narrower v (MLA) is zero-padded
  if dv < q.shape[-1]:
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - dv)])
  out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                     implementation=_fused_impl(q))
  return out[..., :dv]


def _fused_impl(q: jax.Array) -> str | None:
  """'cudnn' compiling for a GPU (sharding/target.py), for 16-bit inputs with a head dim of at
  most 128 in multiples of 8 (cuDNN's flash-attention limits); None (XLA) elsewhere."""
  d = q.shape[-1]
  if target_platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and d <= 128 and d % 8 == 0:
    return "cudnn"
  return None


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                   *, options: AttentionOptions = AttentionOptions(), sinks: jax.Array | None = None) -> jax.Array:
  """Causal GQA on one device's (or one global, GSPMD-partitioned) q[b,l,n,d], k/v[b,s,k,d].

  The one dispatch of every attention path; the flash path here is the per-device kernel
  (no shard_map: callers that hold local blocks, e.g. context parallelism, call this).
  `sinks` [n]: attention sinks (attention_scores.masked_output), on the 'xla' path only."""
  if options.chunk is not None:
    unchunked = dataclasses.replace(options, chunk=None)
    return chunked(lambda q, k, v, s: attention_core(q, k, v, s, options=unchunked, sinks=sinks),
                   q, k, v, segment_ids, options.chunk)
  impl = resolve(options, q.shape[1], k.shape[1])
  if sinks is not None and impl != "xla":
    raise ValueError(f"attention sinks (model.attention_sinks) with model.attention={impl!r}: the "
                     f"{'splash kernel' if impl == 'flash' else 'jax.nn.dot_product_attention'} has no "
                     f"sink logit; use model.attention='xla' or 'auto' (which picks 'xla' with sinks)")
  if impl == "flash":
    return flash.splash_local(q, k, v, segment_ids, window=options.window, softcap=options.softcap,
                              block_q=options.flash_block_q, block_kv=options.flash_block_kv,
                              interpret=options.interpret)
  if impl == "fused":
    if options.softcap is not None:
      raise ValueError("model.attention='fused' has no logit soft-cap (jax.nn.dot_product_attention); "
                       "use model.attention='xla' or 'flash', or model.attention_softcap=None")
    return fused_attention(q, k, v, segment_ids, window=options.window)
  return xla_attention(q, k, v, segment_ids, window=options.window, softcap=options.softcap, sinks=sinks)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
           *, options: AttentionOptions = AttentionOptions(), sinks: jax.Array | None = None) -> jax.Array:
  """`attention_core` on global arrays: the flash kernel runs per device under shard_map
  (layers/flash.py `sharded`); the other paths are left to the SPMD partitioner."""
  if options.chunk is not None:
    unchunked = dataclasses.replace(options, chunk=None)
    return chunked(lambda q, k, v, s: attend(q, k, v, s, options=unchunked, sinks=sinks),
                   q, k, v, segment_ids, options.chunk)
  if sinks is not None:
    return attention_core(q, k, v, segment_ids, options=options, sinks=sinks)
  if resolve(options, q.shape[1], k.shape[1]) == "flash":
    local = functools.partial(attention_core, options=dataclasses.replace(options, implementation="flash"))
    return flash.sharded(lambda q, k, v, s: local(q, k, v, s), q, k, v, segment_ids)
  return attention_core(q, k, v, segment_ids, options=options)


class Attention(nnx.Module):
  """x[b, l, embed] -> x[b, l, embed]: project, rotate, attend causally, project back."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               rope_theta: float = 10_000.0, implementation: str = "xla",
               dtype=jnp.float32, param_dtype=jnp.float32, qkv_bias: bool = False,
               out_bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6,
               rope_scaling: RopeScaling | None = None, rngs: nnx.Rngs,
               options: AttentionOptions | None = None, quantization: str = "none",
               rope: bool = True, temperature: tuple[float, float] | None = None,
               softmax_scale: float | None = None, norm_plus_one: bool = False,
               rope_interleave: bool = False, qk_l2_norm: bool = False):
    """`rope=False`: q and k are not rotated (NoPE). `temperature`: (floor_scale, scale) of
    `query_temperature`, which then multiplies q; None = off. `softmax_scale`: the logits'
    scale (Gemma: query_pre_attn_scalar^-1/2); None = head_dim^-1/2. Every path scales by
    head_dim^-1/2, so q is multiplied by softmax_scale * sqrt(head_dim) once, before any path
    (kernels, context parallelism, the decode cache) sees it. `norm_plus_one`: the q/k norms
    scale by (1 + w) (RMSNorm `plus_one`). `rope_interleave`: RoPE rotates adjacent pairs
    (0, 1), (2, 3), ... (`interleaved_pairs`). `qk_l2_norm`: on a layer that rotates, q and k
    are divided by their RMS over the head dim after RoPE (`unit_rms`, eps `norm_eps`)."""
    if num_heads % num_kv_heads:
      raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    self.rope_theta = rope_theta
    self.rope = rope
    self.rope_interleave = rope_interleave
    self.l2_eps = norm_eps if qk_l2_norm and rope else None
    self.temperature = None if temperature is None else tuple(temperature)
    self.query_factor = None if softmax_scale is None else float(softmax_scale * math.sqrt(head_dim))
    if self.query_factor == 1.0:
      self.query_factor = None
    self.rope_scaling = rope_scaling
    self.options = options or AttentionOptions(implementation)  # validates the name
    self.implementation = self.options.implementation
    kw = dict(dtype=dtype, param_dtype=param_dtype, quantization=quantization, rngs=rngs)
    self.query = DenseGeneral(d_model, (num_heads, head_dim), in_axes=("embed",),
                              out_axes=("heads", "kv"), use_bias=qkv_bias, **kw)
    self.key = DenseGeneral(d_model, (num_kv_heads, head_dim), in_axes=("embed",),
                            out_axes=("kv_heads", "kv"), use_bias=qkv_bias, **kw)
    self.value = DenseGeneral(d_model, (num_kv_heads, head_dim), in_axes=("embed",),
                              out_axes=("kv_heads", "kv"), use_bias=qkv_bias, **kw)
    self.out = DenseGeneral((num_heads, head_dim), d_model, in_axes=("heads", "kv"),
                            out_axes=("embed",), use_bias=out_bias, **kw)
    # Qwen3: RMSNorm over each head's d dims of q and k (one scale shared by all heads).
    norm = lambda: RMSNorm(head_dim, eps=norm_eps, dtype=dtype, param_dtype=param_dtype, axis_name="kv",
                           plus_one=norm_plus_one)
    self.q_norm = norm() if qk_norm else None
    self.k_norm = norm() if qk_norm else None
    # gpt-oss's attention sinks: one logit per query head in the softmax's denominator (0 at init).
    self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype), logical_axes=("heads",)
                           ) if self.options.sinks else None

  def _rotated(self, proj: DenseGeneral, norm: RMSNorm | None, x: jax.Array,
               positions: jax.Array) -> jax.Array:
    """q or k: projected, normalized per head (qk_norm), rotated (RoPE; not for NoPE)."""
    y = proj(x)
    if norm is not None:
      y = norm(y)
    if not self.rope:
      return y
    if self.rope_interleave:
      y = interleaved_pairs(y)
    y = apply_rope(y, positions, self.rope_theta, self.rope_scaling)
    return y if self.l2_eps is None else unit_rms(y, self.l2_eps)

  def _query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """q [b, l, heads, kv]: rotated, then scaled by its temperature when the layer tunes it and
    by `query_factor` when the softmax scale is not head_dim^-1/2."""
    q = self._rotated(self.query, self.q_norm, x, positions)
    if self.temperature is not None:
      q = (q * query_temperature(positions, *self.temperature)).astype(q.dtype)
    if self.query_factor is not None:
      q = (q.astype(jnp.float32) * jnp.float32(self.query_factor)).astype(q.dtype)
    return shard(q, ("batch", "length", "heads", "kv"))

  def __call__(self, x: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    if positions is None:
      positions = default_positions(x.shape[0], x.shape[1])
    q = self._query(x, positions)
    k = shard(self._rotated(self.key, self.k_norm, x, positions), ("batch", "length", "kv_heads", "kv"))
    v = shard(self.value(x), ("batch", "length", "kv_heads", "kv"))
    q, k, v = (checkpoint_name(t, n) for t, n in zip((q, k, v), ("query_proj", "key_proj", "value_proj")))
    split = context_parallel.length_split()  # `length` on a mesh axis: context parallel
    if split is not None:
      if self.options.chunk is not None:
        raise ValueError(f"chunked attention (model.layer_pattern kind with chunk={self.options.chunk}) "
                         f"with context parallelism (the rules split 'length'): not supported; shard "
                         f"'length' on no mesh axis, or use a window instead of a chunk")
      o = context_parallel.attention(q, k, v, segment_ids, split, options=self.options, sinks=self._sinks())
    else:
      o = attend(q, k, v, segment_ids, options=self.options, sinks=self._sinks())
    o = shard(o, ("batch", "length", "heads", "kv"))
    return checkpoint_name(self.out(o), "out_proj")  # names: the offload remat policies (transformer.py)

  def _sinks(self) -> jax.Array | None:
    """The sink logits [heads] (float32), or None without sinks."""
    return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

  def cached(self, x: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """(out, cache after writing this block's k/v): a prefill (x[b, l > 1], positions
    0..l-1, -1 on padding) or one generate step (x[b, 1] at positions[b, 0]), on a full or a
    ring cache (`kv_cache_spec`); see the module docstring."""
    q = self._query(x, positions)
    k = self._rotated(self.key, self.k_norm, x, positions)
    v = self.value(x)
    cache = write_kv(cache, k, v, positions)
    if x.shape[1] > 1:  # prefill: the block's own keys are all it may see (causal from 0)
      k = shard(k, ("batch", "length", "kv_heads", "kv"))
      v = shard(v, ("batch", "length", "kv_heads", "kv"))
      o = attend(q, k, v, options=self.options, sinks=self._sinks())
    else:
      o = cached_attention(q, cache["k"], cache["v"], positions, window=self.options.window,
                           softcap=self.options.softcap, chunk=self.options.chunk, sinks=self._sinks(),
                           held=cache.get("held"))
    o = shard(o, ("batch", "length", "heads", "kv"))
    return self.out(o), cache


CACHE_AXES = ("cache_batch", "cache_length", "kv_heads", "kv")
HELD_AXES = ("cache_batch", "cache_length")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
  """Shape, dtype and logical axes of one cache array (a pytree leaf: not registered)."""
  shape: tuple[int, ...]
  dtype: Any
  axes: tuple[str | None, ...]

  def stacked(self, num: int, axis: str = "layers") -> "CacheSpec":
    """The same array for `num` stacked layers: leading dim `num`, logical name `axis`."""
    return CacheSpec((num,) + self.shape, self.dtype, (axis,) + self.axes)


def kv_cache_spec(batch: int, length: int, kv_heads: int, head_dim: int, dtype,
                  span: int | None = None) -> dict:
  """The decode cache of one attention layer for `length` positions. `span`: the most
  positions one query sees (the layer's window or chunk; None = all). With span < length, a
  ring of `span` slots {'k', 'v': [batch, span, kv_heads, head_dim], 'held': int32 [batch,
  span]}; else the full {'k', 'v': [batch, length, kv_heads, head_dim]}."""
  slots = length if span is None else min(span, length)
  one = CacheSpec((batch, slots, kv_heads, head_dim), jnp.dtype(dtype), CACHE_AXES)
  if slots == length:
    return {"k": one, "v": one}
  return {"k": one, "v": one, "held": CacheSpec((batch, slots), jnp.dtype(jnp.int32), HELD_AXES)}


def write_kv(cache: dict, k: jax.Array, v: jax.Array, positions: jax.Array) -> dict:
  """The cache {'k', 'v'[, 'held']} with k/v[b, l, kv, d] at `positions`[b, l] written: into
  slots by position (`write_cache`) for a full cache, into a ring (`write_ring`) for one with
  'held'."""
  if "held" in cache:
    cache = write_ring(cache, k, v, positions)
  else:
    cache = {"k": write_cache(cache["k"], k, positions), "v": write_cache(cache["v"], v, positions)}
  return {name: shard(a, HELD_AXES if name == "held" else CACHE_AXES) for name, a in cache.items()}


def write_cache(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
  """cache[b, S, ...] (k/v: [b, S, k, d]) with `new`[b, l, ...] written at each row's `positions`.

  l > 1 is a prefill from position 0 (slots 0..l-1); l = 1 writes slot positions[b]
  of each row, as an elementwise select, which splits over any cache sharding.
  """
  new = new.astype(cache.dtype)
  if new.shape[1] > 1:
    return jax.lax.dynamic_update_slice_in_dim(cache, new, 0, axis=1)
  slots = jnp.arange(cache.shape[1], dtype=jnp.int32)
  hit = (slots[None, :] == positions[:, :1]).reshape(cache.shape[:2] + (1,) * (cache.ndim - 2))  # [b, S, 1..]
  return jnp.where(hit, new, cache)


def write_ring(cache: dict, k: jax.Array, v: jax.Array, positions: jax.Array) -> dict:
  """A ring cache {'k', 'v': [b, R, kv, d], 'held': [b, R]} with k/v[b, l, kv, d] written.

  Prefill (l > 1, positions 0..l-1 with -1 on padding): slot s of row b takes the row's latest
  prompt position p = last - (last - s) mod R (last = the row's largest position), read from
  the block at index p; p < 0 or a padding token leaves the slot empty. A generate step (l = 1)
  writes slot positions[b] mod R, as an elementwise select (splits over any cache sharding)."""
  size = cache["k"].shape[1]
  slots = jnp.arange(size, dtype=jnp.int32)[None, :]
  if k.shape[1] > 1:
    last = jnp.max(positions, axis=1, keepdims=True)                              # [b, 1]
    src = last - jnp.mod(last - slots, size)                                      # [b, R]
    index = jnp.clip(src, 0, k.shape[1] - 1)
    held = jnp.where(src >= 0, jnp.take_along_axis(positions, index, axis=1) + 1, 0)
    keep = (held > 0)[:, :, None, None]
    take = lambda a, into: jnp.where(keep, jnp.take_along_axis(a, index[:, :, None, None], axis=1),
                                     0).astype(into.dtype)
    return {"k": take(k, cache["k"]), "v": take(v, cache["v"]), "held": held.astype(jnp.int32)}
  hit = slots == jnp.mod(positions[:, :1], size)                                  # [b, R]
  put = lambda new, old: jnp.where(hit[:, :, None, None], new.astype(old.dtype), old)
  return {"k": put(k, cache["k"]), "v": put(v, cache["v"]),
          "held": jnp.where(hit, positions[:, :1] + 1, cache["held"]).astype(jnp.int32)}


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                     window: int | None = None, softcap: float | None = None,
                     chunk: int | None = None, sinks: jax.Array | None = None,
                     held: jax.Array | None = None) -> jax.Array:
  """q[b,l,n,d] at `positions`[b,l] against the cache k/v[b,S,k,d]: the slots whose position
  p satisfies p <= position (and p > position - window with a sliding window, p // chunk ==
  position // chunk with chunked attention), logits soft-capped as in training. `held`
  [b, S]: a ring's 1 + position of each slot (0 = empty, never seen); None: slot j holds
  position j (a full cache)."""
  logits = grouped_logits(q, k, softcap)
  if held is None:
    held = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] + 1
  p = (held - 1)[:, None, :]                                             # [b|1, 1, S]
  at = positions[:, :, None]                                             # [b, l, 1]
  visible = (p >= 0) & (p <= at)
  if window is not None:
    visible = visible & (p > at - window)
  if chunk is not None:
    visible = visible & (p // chunk == at // chunk)
  return masked_output(logits, visible[:, None, None], v, sinks)   # visible [b,1,1,l,S]


def default_positions(batch: int, length: int) -> jax.Array:
  """int32[batch, length] = 0 .. length-1 on every row."""
  return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
