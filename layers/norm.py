"""RMSNorm and LayerNorm over the last (embed) dim, statistics in float32.

Mean/variance of a bfloat16 vector lose most of their bits (8-bit mantissa), so the
input is upcast, normalized and scaled in float32, and only the result is cast back
to the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale  (no centering, no bias).

  `plus_one`: the param holds w and the scale is (1 + w), w initialized to 0 (Gemma's
  convention): checkpoints store w, so import and export stay a pure copy, and the sum is
  formed in float32 as Gemma computes it."""

  def __init__(self, features: int, *, eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32, axis_name: str = "embed", plus_one: bool = False,
               rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init; accepted so all layers share one constructor shape
    self.eps = eps
    self.dtype = dtype
    self.plus_one = plus_one
    init = jnp.zeros if plus_one else jnp.ones
    self.scale = nnx.Param(init((features,), param_dtype), logical_axes=(axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    return (y * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


class LayerNorm(nnx.Module):
  """y = (x - mean) / sqrt(var + eps) * scale + bias."""

  def __init__(self, features: int, *, eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((features,), param_dtype), logical_axes=("embed",))
    self.bias = nnx.Param(jnp.zeros((features,), param_dtype), logical_axes=("embed",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


NORMS = ("rms", "rms_plus_one", "layer")   # model.norm's choices (configs/schema.py names them too)


def make_norm(kind: str, features: int, *, dtype, param_dtype, eps: float = 1e-6) -> RMSNorm | LayerNorm:
  """The norm a config names: 'rms', 'rms_plus_one' (RMSNorm scaled by 1 + w) or 'layer'."""
  if kind not in NORMS:
    raise ValueError(f"norm={kind!r}: use one of {NORMS}")
  if kind == "layer":
    return LayerNorm(features, eps=eps, dtype=dtype, param_dtype=param_dtype)
  return RMSNorm(features, eps=eps, dtype=dtype, param_dtype=param_dtype, plus_one=kind == "rms_plus_one")
