"""Feed-forward blocks: gated (GLU family: SwiGLU with silu, GeGLU with gelu) and plain.

    h = act(x @ W_gate) * (x @ W_up)      [batch, length, mlp]
    y = h @ W_down                        [batch, length, embed]

The hidden activation is annotated ('batch', 'length', 'mlp') so that tensor-parallel
rules (mlp -> model axis) keep it split between the two matmuls: one all-reduce after
W_down, none in between (the Megatron MLP pattern).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.layers.linear import DenseGeneral
from shardax.sharding import shard


def activation_fn(name: str):
  """A jax.nn activation by name ('silu', 'gelu', 'relu', ...)."""
  fn = getattr(jax.nn, name, None)
  if fn is None or not callable(fn):
    raise ValueError(f"activation={name!r} is not a jax.nn function (try 'silu' or 'gelu')")
  return fn


class GatedMLP(nnx.Module):
  """embed -> (gate, up) mlp -> act(gate) * up -> down embed."""

  def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu",
               dtype=jnp.float32, param_dtype=jnp.float32, use_bias: bool = False,
               quantization: str = "none", rngs: nnx.Rngs):
    self.act = activation_fn(activation)
    kw = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, quantization=quantization, rngs=rngs)
    self.gate = DenseGeneral(d_model, d_ff, in_axes=("embed",), out_axes=("mlp",), **kw)
    self.up = DenseGeneral(d_model, d_ff, in_axes=("embed",), out_axes=("mlp",), **kw)
    self.down = DenseGeneral(d_ff, d_model, in_axes=("mlp",), out_axes=("embed",), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.act(self.gate(x)) * self.up(x)
    h = shard(h, ("batch", "length", "mlp"))
    return self.down(h)


class PlainMLP(nnx.Module):
  """embed -> mlp -> act -> embed: the two-matrix FFN of T5 (ReLU) and GPT (GELU)."""

  def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu",
               dtype=jnp.float32, param_dtype=jnp.float32, use_bias: bool = False,
               quantization: str = "none", rngs: nnx.Rngs):
    self.act = activation_fn(activation)
    kw = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, quantization=quantization, rngs=rngs)
    self.up = DenseGeneral(d_model, d_ff, in_axes=("embed",), out_axes=("mlp",), **kw)
    self.down = DenseGeneral(d_ff, d_model, in_axes=("mlp",), out_axes=("embed",), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = shard(self.act(self.up(x)), ("batch", "length", "mlp"))
    return self.down(h)
