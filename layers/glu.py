"""The experts' gated activation, hidden = glu(gate, up), and gpt-oss's clamped SwiGLU.

An expert FFN is down(glu(x W_gate + b_gate, x W_up + b_up)) (+ b_down). Most models use
glu(gate, up) = act(gate) * up (SwiGLU with silu). gpt-oss (transformers' GptOssExperts)
clamps both halves and adds one to the up half:

    gate = min(gate, limit)          up = clip(up, -limit, limit)
    glu  = (up + 1) * gate * sigmoid(alpha * gate)             (alpha 1.702, limit 7.0)

`model.moe.swiglu_limit` (configs/moe.py) turns it on. The dispatch paths
(layers/moe_dispatch.py: ragged_dot, tiled, megablox; layers/moe.py: capacity) take either a
unary activation or a `ClampedSwiGLU` and go through `gated`, so every path computes the same
hidden activation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
  """gpt-oss's expert activation (module docstring); hashable, so a static argument."""
  alpha: float = 1.702
  limit: float = 7.0

  def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    gate = jnp.minimum(gate, jnp.asarray(self.limit, gate.dtype))
    up = jnp.clip(up, -self.limit, self.limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * jnp.asarray(self.alpha, gate.dtype)))


def gated(act: Callable) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """glu(gate, up): `act` itself when it is a ClampedSwiGLU, else act(gate) * up."""
  if isinstance(act, ClampedSwiGLU):
    return act
  return lambda gate, up: act(gate) * up


def row_experts(sizes: jax.Array, rows: int) -> jax.Array:
  """int32[rows]: the expert (group) of each row of rows sorted by expert, `sizes[e]` rows per
  expert; rows past sum(sizes) get the last expert (their outputs are discarded)."""
  ends = jnp.cumsum(sizes)
  group = jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right")
  return jnp.minimum(group, sizes.shape[0] - 1).astype(jnp.int32)
