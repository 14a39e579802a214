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


class _FeedForward(nnx.Module):
  """embed -> mlp -> embed, gated or not (`gated`, set by each subclass): the projections
  named gate (gated only), up and down, built in that order from one set of options."""
  gated: bool

  def __init__(self, d_model: int, d_ff: int, *, activation: str,
               dtype=jnp.float32, param_dtype=jnp.float32, use_bias: bool = False,
               quantization: str = "none", rngs: nnx.Rngs):
    self.act = activation_fn(activation)
    kw = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, quantization=quantization, rngs=rngs)
    if self.gated:
      self.gate = DenseGeneral(d_model, d_ff, in_axes=("embed",), out_axes=("mlp",), **kw)
    self.up = DenseGeneral(d_model, d_ff, in_axes=("embed",), out_axes=("mlp",), **kw)
    self.down = DenseGeneral(d_ff, d_model, in_axes=("mlp",), out_axes=("embed",), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
    return self.down(shard(h, ("batch", "length", "mlp")))


class GatedMLP(_FeedForward):
  """embed -> (gate, up) mlp -> act(gate) * up -> down embed."""
  gated = True

  def __init__(self, d_model: int, d_ff: int, *, activation: str = "silu", **options):
    super().__init__(d_model, d_ff, activation=activation, **options)


class PlainMLP(_FeedForward):
  """embed -> mlp -> act -> embed: the two-matrix FFN of T5 (ReLU) and GPT (GELU)."""
  gated = False

  def __init__(self, d_model: int, d_ff: int, *, activation: str = "relu", **options):
    super().__init__(d_model, d_ff, activation=activation, **options)
