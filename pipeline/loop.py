"""Pipeline parallelism as tensor sharding: the loop (GSPMD paper, section 3.3).

No stage runs its own program. The S stages' weights are one array with a
leading `stage` dim; every iteration one vmapped stage body runs all stages at
once on a buffer [S, microbatch, ...] whose stage dim, like the weights', the
rules map to a `stage` mesh axis, so each device group computes its own stage.
Shifting the buffer right by one stage (`jnp.roll` on the stage dim) is the only
cross-stage traffic, and the SPMD partitioner turns it into a collective-permute
between neighbouring stage groups. `jax.vmap(spmd_axis_name=...)` tells the
partitioner that the vmapped dim lives on that mesh axis, so the sharding
annotations inside the stage body (batch on `data`, heads on `model`, ...) keep
working: pipeline x data x tensor parallelism on one mesh, from annotations alone.
The schedule and its bubble are in schedule.py (with pseudocode).

The batch is cut into microbatches by taking every M-th row (row i*M + j goes to
microbatch j), so each microbatch keeps the batch dim's data sharding and no
example moves between devices. Bubble iterations compute on stale or zero
buffers; their outputs never reach `held` (written only when a real microbatch
leaves the last stage) and so add exactly zero to results and gradients.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from absl import logging

from shardax.pipeline.schedule import PipelineError, Schedule
from shardax.pipeline.stages import from_stages
from shardax.sharding import rules as rules_lib
from shardax.sharding import shard
from shardax.sharding.annotate import current_mesh_shape

# (stacked weights of some layers, x, positions) -> x: runs those layers in order, so the
# same function runs one stage's L/(S*R) layers or, unpipelined, all L of them.
StageFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


def mesh_axes_of(logical: str) -> str | tuple[str, ...] | None:
  """The mesh axis (or axes) the rules in force give a dim named `logical`, or None.

  None without a mesh, without rules, or on one device: then the stage dim is not
  split and the pipeline runs its stages one after another on every device.
  """
  rules, mesh_shape = rules_lib.current_rules(), current_mesh_shape()
  if rules is None or mesh_shape is None or math.prod(mesh_shape.values()) == 1:
    return None
  return rules_lib.logical_to_spec((logical,), rules, mesh_shape)[0]


def _check_data_split(rows: int, batch_axes: Sequence[str | None], m: int) -> None:
  """Each microbatch must still split evenly over the batch dim's mesh axes."""
  rules, mesh_shape = rules_lib.current_rules(), current_mesh_shape()
  if rules is None or mesh_shape is None or rules_lib.allow_uneven():
    return
  axes = rules_lib.logical_to_spec(batch_axes[:1], rules, mesh_shape)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  degree = math.prod(mesh_shape[a] for a in axes)
  if rows % degree:
    raise PipelineError(
        f"a microbatch has {rows} rows (batch / model.pipeline.microbatches={m}), which the "
        f"data-parallel degree {degree} (mesh axes {axes}) does not divide; use a global batch "
        f"that is a multiple of microbatches x {degree}, or fewer microbatches")


def split_microbatches(x: jax.Array, m: int, axes: Sequence[str | None]) -> jax.Array:
  """[B, ...] -> [M, B/M, ...], row i*M + j -> [j, i]: rows stay on their devices."""
  x = x.reshape((x.shape[0] // m, m) + x.shape[1:]).swapaxes(0, 1)
  return shard(x, (None,) + tuple(axes))


def merge_microbatches(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """The inverse of `split_microbatches`."""
  x = x.swapaxes(0, 1)
  return shard(x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), tuple(axes))


def run(stage_fn: StageFn, weights: Any, x: jax.Array, positions: jax.Array,
        schedule: Schedule, x_axes: Sequence[str | None] = ("batch", "length", "embed")) -> jax.Array:
  """x [B, ...] through S stages x R repeats of `stage_fn`; returns [B, ...].

  weights: pytree, every leaf [S, ...] (R = 1) or [S, R, ...] (see stages.py);
  stage_fn(w, x_mb, positions_mb) runs one stage's layers (`w` without the
  stage/repeat dims) on one microbatch; positions: int [B, length]. A batch
  smaller than M (decoding) skips the schedule: all layers run in order.
  """
  S, M, R = schedule.stages, schedule.microbatches, schedule.repeats
  lead = (S,) if R == 1 else (S, R)
  for leaf in jax.tree.leaves(weights):
    if tuple(leaf.shape[:len(lead)]) != lead:
      raise PipelineError(f"stage weights of shape {leaf.shape} do not start with (stages, "
                          f"[circular_repeats]) = {lead}; lay them out with pipeline.to_stages")
  if x.shape[0] < M:  # e.g. decoding one sequence: nothing to pipeline, same numbers in order
    logging.warning("pipeline: a batch of %d rows < model.pipeline.microbatches=%d; running "
                    "the %d stages one after another", x.shape[0], M, S)
    return stage_fn(jax.tree.map(lambda a: from_stages(a, R), weights), x, positions)
  rows = schedule.check_batch(x.shape[0])
  _check_data_split(rows, x_axes, M)
  state_axes = ("stage",) + tuple(x_axes)
  xs = split_microbatches(x, M, x_axes)
  pos = split_microbatches(positions, M, tuple(x_axes[:positions.ndim]))
  stage_ids = jnp.arange(S)

  def one_stage(w, h, p, k):
    if R > 1:  # this stage's chunk for the repeat it is on (clipped in the bubble)
      r = jnp.clip(k // M, 0, R - 1)
      w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), w)
    return stage_fn(w, h, p).astype(h.dtype)

  all_stages = jax.vmap(one_stage, spmd_axis_name=mesh_axes_of("stage"))

  def iteration(carry, t):
    buffer, held = carry
    m = t % M
    fresh = jax.lax.dynamic_index_in_dim(xs, m, 0, keepdims=False)
    if R > 1:  # repeat r > 0: the microbatch comes back from the last stage
      fresh = jnp.where(t < M, fresh, jax.lax.dynamic_index_in_dim(held, m, 0, keepdims=False))
    shifted = jnp.roll(buffer, 1, axis=0)  # the collective-permute between stages
    first = (stage_ids == 0).reshape((S,) + (1,) * fresh.ndim)
    buffer = shard(jnp.where(first, fresh[None], shifted), state_axes)
    k = t - stage_ids  # the work item of each stage; outside [0, M*R) = bubble
    out = shard(all_stages(weights, buffer, pos[k % M], k), state_axes)
    done = t - (S - 1)  # the microbatch leaving the last stage, if any
    slot = done % M
    keep = jax.lax.dynamic_index_in_dim(held, slot, 0, keepdims=False)
    held = jax.lax.dynamic_update_index_in_dim(held, jnp.where(done >= 0, out[S - 1], keep), slot, 0)
    return (out, shard(held, (None,) + tuple(x_axes))), None

  buffer = shard(jnp.zeros((S,) + xs.shape[1:], x.dtype), state_axes)
  held = jnp.zeros_like(xs)
  (_, held), _ = jax.lax.scan(iteration, (buffer, held), jnp.arange(schedule.iterations))
  return merge_microbatches(held, x_axes)
