"""Where the circular schedule keeps a microbatch between two passes over the stages.

With R > 1 repeats, microbatch m leaves the last stage (repeat r) at the end of
iteration r*M + m + S - 1 and re-enters stage 0 at (r+1)*M + m: D = M - S + 1
iterations later (schedule.py). The stage buffer's own shift already carries a
value one step, from stage S-1 round to stage 0, so it waits E = M - S more
(with the delayed shift, h = 2 iterations a hop: E = M - 2S from group 0, or
M - 2S + 1 from group S-1, where it enters one iteration after it was made).

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
  E >= S (or E = 0): K = ceil(E/S); the newest output enters at group 0 (where the stage
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

  def __init__(self, stages: int, microbatches: int, hop: int, x_axes: Sequence[str | None]):
    # A microbatch leaving the last stage at iteration u is due at stage 0 at u + M - h(S-1).
    # Entering at group 0 (where the buffer's shift brings it at u + h) it waits M - h*S;
    # entering at group S-1 (from the last stage's output, at u + 1) M - h*S + h - 1.
    wait = microbatches - hop * stages
    self.stages = stages
    if wait >= stages or wait == 0:  # a lap over every group from group 0, or none at all
      self.start, self.wait = 0, wait
      self.slots = -(-wait // stages)
      keep = wait // stages + (np.arange(stages) < wait % stages)
    else:  # all on the last group
      self.start, self.wait = stages - 1, wait + hop - 1
      self.slots = self.wait
      keep = np.where(np.arange(stages) == stages - 1, self.wait, 0)
    self.entry = self.slots - keep  # = K for a group that keeps nothing: it never takes arrivals
    self.axes = ("stage", None) + tuple(x_axes)

  def init(self, xs: jax.Array) -> tuple[jax.Array, jax.Array] | None:
    """(empty slots [S, K, microbatch, ...], what they pass on next) (None when nothing waits)."""
    if not self.wait:
      return None
    waiting = shard(jnp.zeros((self.stages, self.slots) + xs.shape[1:], xs.dtype), self.axes)
    return waiting, self._moved(waiting)

  def _moved(self, waiting: jax.Array) -> jax.Array:
    """Each group's oldest slot, one group on (group S-1's to group 0: the one due there)."""
    return shard(jnp.roll(waiting[:, self.slots - 1], 1, axis=0), self.axes[:1] + self.axes[2:])

  def step(self, state, out: jax.Array, shifted: jax.Array):
    """(due, queue state after the newest output went in); due[0]: the microbatch due at stage 0.

    out: the stages' outputs of the last iteration [S, ...]; shifted: what the stage
    buffer's shift brings to each stage now (shifted[0]: the last stage's output, on
    group 0). `due` keeps the stage dim so the loop selects stage 0's input elementwise,
    with no slice of a stage-split dim (whose transpose would be an all-reduce).
    The hop between groups (a collective-permute) of what is due next iteration is
    taken here, from slots that do not depend on this iteration's stage computation,
    so it runs beside that computation instead of before the next one.
    """
    if state is None:  # nothing waits: the buffer's shift alone delivers it
      return shifted, None
    waiting, moved = state
    S, K = self.stages, self.slots
    lanes = (1,) * (out.ndim - 1)
    newest = shifted if self.start == 0 else out  # the last stage's output where it enters: group 0 or S-1
    arriving = jnp.where((np.arange(S) == self.start).reshape((S,) + lanes), newest, moved)
    advanced = jnp.concatenate([arriving[:, None], waiting[:, :-1]], axis=1)
    if self.entry.any():  # groups that keep fewer slots take arrivals later (or never)
      at_entry = (np.arange(K)[None, :] == self.entry[:, None]).reshape((S, K) + lanes)
      advanced = jnp.where(at_entry, arriving[:, None], advanced)
    advanced = shard(advanced, self.axes)
    return moved, (advanced, self._moved(advanced))
