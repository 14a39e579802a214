"""The stage layout of a stacked layer's weights: [L, ...] <-> [S, (R,) L/(S*R), ...].

A scanned stack of L identical layers has every weight stacked on a leading
`layers` dim. Pipelining reshapes that dim into `stage` first (the rules map it
to a `stage` mesh axis, so each stage's layers live on its own devices), then,
for the circular schedule, `repeat`, then the L/(S*R) layers one stage runs per
visit. Layer l sits at

    R = 1:  [s, j]      with l = s*(L/S) + j
    R > 1:  [s, r, j]   with l = r*(L/R) + s*(L/(S*R)) + j

which is the order a microbatch meets them (see schedule.py), so a pipelined
model computes exactly what the unpipelined stack with the same [L, ...]
weights computes, and `from_stages` turns its weights (or gradients) back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.pipeline.schedule import PipelineError


def stage_axes(repeats: int) -> tuple[str, ...]:
  """Logical names of the leading dims that replace `layers`' outer part."""
  return ("stage",) if repeats == 1 else ("stage", "repeat")


def to_stages(a: jax.Array, stages: int, repeats: int = 1) -> jax.Array:
  """[L, ...] -> [S, L/S, ...] (R = 1) or [S, R, L/(S*R), ...] in schedule order."""
  L = a.shape[0]
  if L % (stages * repeats):
    raise PipelineError(f"{L} layers do not split into pipeline stages x circular_repeats = "
                        f"{stages} x {repeats}; make model.num_layers a multiple of {stages * repeats}")
  per = L // (stages * repeats)
  if repeats == 1:
    return a.reshape((stages, per) + a.shape[1:])
  return jnp.swapaxes(a.reshape((repeats, stages, per) + a.shape[1:]), 0, 1)


def from_stages(a: jax.Array, repeats: int = 1) -> jax.Array:
  """The inverse of `to_stages`: stage-layout weights back to [L, ...]."""
  if repeats == 1:
    return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])
  a = jnp.swapaxes(a, 0, 1)
  return a.reshape((a.shape[0] * a.shape[1] * a.shape[2],) + a.shape[3:])


def restack_module(blocks: nnx.Module, stages: int, repeats: int = 1) -> nnx.Module:
  """Reshape every param of a `stacked_blocks` module into the stage layout, in place.

  Its `logical_axes` (`layers`, ...) become (`stage`, [`repeat`,] `layers`, ...).
  Creating the L layers first and restacking keeps the init of a pipelined model
  identical to the unpipelined one with the same seed.
  """
  for _, node in nnx.iter_graph(blocks):
    if isinstance(node, nnx.Variable):
      names = tuple(node.get_metadata().get("logical_axes", ()) or ())
      if not names or names[0] != "layers":
        raise PipelineError(f"stacked param with logical axes {names} has no leading 'layers' dim")
      node.set_value(to_stages(node.get_value(), stages, repeats))
      node.set_metadata(logical_axes=stage_axes(repeats) + names)
  return blocks


def unstage_params(tree, repeats: int = 1):
  """Every array in `tree` (e.g. params['layers']) from the stage layout back to [L, ...]."""
  return jax.tree.map(lambda a: from_stages(a, repeats), tree)


def stage_params(tree, stages: int, repeats: int = 1):
  """Every array in `tree` from [L, ...] to the stage layout."""
  return jax.tree.map(lambda a: to_stages(a, stages, repeats), tree)
