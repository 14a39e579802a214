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
  """y = x / sqrt(mean(x^2) + eps) * scale  (no centering, no bias)."""

  def __init__(self, features: int, *, eps: float = 1e-6, dtype=jnp.float32,
               param_dtype=jnp.float32, axis_name: str = "embed", rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init; accepted so all layers share one constructor shape
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((features,), param_dtype), logical_axes=(axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


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


def make_norm(kind: str, features: int, *, dtype, param_dtype, eps: float = 1e-6) -> RMSNorm | LayerNorm:
  """The norm a config names: 'rms' or 'layer'."""
  cls = {"rms": RMSNorm, "layer": LayerNorm}.get(kind)
  if cls is None:
    raise ValueError(f"norm={kind!r}: use 'rms' or 'layer'")
  return cls(features, eps=eps, dtype=dtype, param_dtype=param_dtype)
