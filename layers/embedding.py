"""Token embedding, usable in reverse (`attend`) as a tied output head.

Scale convention (as in Praxis `scale_sqrt_depth`): the table is initialized with
std 1/sqrt(embed) and looked-up rows are multiplied by sqrt(embed). Lookups then
have unit RMS (what a pre-norm residual stream expects) while `attend`, a dot of a
unit-RMS normalized vector with rows of std 1/sqrt(embed), yields logits of order 1
at init. One table serves both ends without a separate scale for each.

Lookup: vocabularies up to ONE_HOT_MAX_VOCAB rows are looked up as one_hot(tokens) @ table.
A gather's gradient is a scatter-add of every token's gradient row into the table, and with
few rows many tokens hit the same one (what that scatter cost a small-vocabulary step on an
H100: docs/results/code_notes.md). The one-hot product's gradient is a plain matmul, and the
lookup is exact (one nonzero term per output, at HIGHEST precision so f32 tables are not
rounded to bf16 on TPU or tf32 on GPU); its extra FLOPs, 2 x tokens x vocab x embed, are
under 1% of a step at these vocab sizes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


ONE_HOT_MAX_VOCAB = 4096


class Embed(nnx.Module):
  """`embedding[vocab, embed]`; `__call__` looks tokens up, `attend` scores vocab rows."""

  def __init__(self, num_embeddings: int, features: int, *,
               dtype=jnp.float32, param_dtype=jnp.float32, scale: bool = True, rngs: nnx.Rngs):
    self.features = features
    self.scale = scale   # False: rows as stored (Hugging Face checkpoints have no sqrt(embed) factor)
    self.dtype = dtype
    init = nnx.initializers.normal(stddev=1.0 / math.sqrt(features))
    self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype),
                               logical_axes=("vocab", "embed"))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int[...]  ->  dtype[..., embed], rows scaled by sqrt(embed)."""
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"Embed expects integer token ids, got {tokens.dtype}")
    table = self.embedding[...].astype(self.dtype)
    if table.shape[0] <= ONE_HOT_MAX_VOCAB:
      rows = jnp.einsum("...v,vd->...d", jax.nn.one_hot(tokens, table.shape[0], dtype=self.dtype), table,
                        precision=jax.lax.Precision.HIGHEST)
    else:
      rows = jnp.take(table, tokens, axis=0)
    return rows * jnp.asarray(math.sqrt(self.features), self.dtype) if self.scale else rows

  def attend(self, x: jax.Array) -> jax.Array:
    """x[..., embed] -> float32 logits[..., vocab] (operands in dtype, accumulation in f32)."""
    table = self.embedding[...].astype(self.dtype)
    return jnp.einsum("...d,vd->...v", x.astype(self.dtype), table,
                      preferred_element_type=jnp.float32)
