"""Where the circular schedule keeps a microbatch between two passes over the stages.

With R > 1 repeats, microbatch m leaves the last stage (repeat r) at the end of
iteration r*M + m + S - 1 and re-enters stage 0 at (r+1)*M + m: D = M - S + 1
iterations later (schedule.py). The stage buffer's own shift already carries a
value one step, from stage S-1 round to stage 0, so it waits E = M - S more.

The wait is a first-in-first-out queue laid out like the stages: [S, K,
microbatch, ...] with the stage dim on the `stage` mesh axis, so every stage group
holds K slots, never all M microbatches. Each iteration every group passes its
oldest slot to the next group (a `jnp.roll` on the stage dim: one
collective-permute of one microbatch, beside the stage buffer's), moves the rest
one slot on locally, and takes what arrives; group S-1's oldest rolls round to
group 0, where stage 0 takes it:

    waiting = zeros[S, K, ...]                 # group g uses slots entry[g] .. K-1
    each iteration:
      moved = roll(waiting[:, K-1], 1)          # moved[0]: the microbatch due at stage 0 now
      arriving = moved; arriving[start] = the last stage's newest output
      waiting[g, entry[g]] = arriving[g]; waiting[g, k > entry[g]] = waiting[g, k - 1]
      return moved[0]

Group g keeps each microbatch K - entry[g] iterations, E in all, so it comes out
exactly E iterations after it went in. Two layouts, by E:
  E >= S: K = ceil(E/S); the newest output enters at group 0 (where the stage
          buffer's shift has just brought it) and visits every group, E % S of
          them keeping one slot more: K <= M/S microbatches per group.
  E <  S: K = E; it stays on group S-1, where the last stage made it (a hop costs
          an iteration, so a lap over all S groups would be too slow); every group
          holds E < S slots, only the last group's used.
Only moves and selects touch the queue, so autodiff saves nothing of it per
iteration: the backward pass carries the queue's cotangent (the same K slots per
group) and replays the moves in reverse.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from shardax.sharding import shard


class Queue:
  """A FIFO of `wait` microbatches split over S stage groups (see the module docstring)."""

  def __init__(self, stages: int, wait: int, x_axes: Sequence[str | None]):
    self.stages, self.wait = stages, wait
    if wait >= stages:  # a lap over every group, from group 0
      self.start, self.slots = 0, -(-wait // stages)
      keep = wait // stages + (np.arange(stages) < wait % stages)
    else:  # all on the last group
      self.start, self.slots = stages - 1, wait
      keep = np.where(np.arange(stages) == stages - 1, wait, 0)
    self.entry = self.slots - keep  # = K for a group that keeps nothing: it never takes arrivals
    self.axes = ("stage", None) + tuple(x_axes)

  def init(self, xs: jax.Array) -> jax.Array | None:
    """Empty slots [S, K, microbatch, ...] (None when nothing waits: M = S)."""
    if not self.wait:
      return None
    return shard(jnp.zeros((self.stages, self.slots) + xs.shape[1:], xs.dtype), self.axes)

  def step(self, waiting: jax.Array | None, out: jax.Array,
           shifted: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """(due, queue after the newest output went in); due[0]: the microbatch due at stage 0.

    out: the stages' outputs of the last iteration [S, ...]; shifted: the same
    rolled one stage on (shifted[0] = out[S-1], on group 0), as the loop made it.
    `due` keeps the stage dim so the loop selects stage 0's input elementwise,
    with no slice of a stage-split dim (whose transpose would be an all-reduce).
    """
    if waiting is None:  # M = S: the buffer's shift alone delivers it, one iteration on
      return shifted, None
    S, K = self.stages, self.slots
    lanes = (1,) * (out.ndim - 1)
    moved = jnp.roll(waiting[:, K - 1], 1, axis=0)  # oldest slot -> next group; group S-1's -> due
    newest = shifted if self.start == 0 else out  # out[S-1] where it enters: group 0 or S-1
    arriving = jnp.where((np.arange(S) == self.start).reshape((S,) + lanes), newest, moved)
    advanced = jnp.concatenate([arriving[:, None], waiting[:, :-1]], axis=1)
    if self.entry.any():  # groups that keep fewer slots take arrivals later (or never)
      at_entry = (np.arange(K)[None, :] == self.entry[:, None]).reshape((S, K) + lanes)
      advanced = jnp.where(at_entry, arriving[:, None], advanced)
    return moved, shard(advanced, self.axes)
