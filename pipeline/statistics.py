"""Stage weights whose uses combine by max, not by sum: running statistics.

The loop runs each stage's weights in every one of its M*R + S - 1 iterations, bubble
included, and autodiff sums the cotangents of those uses. That is right for a weight's
gradient and wrong for a statistic whose "gradient" is its next value, such as the fp8
amax history (layers/quantization.py): its next newest entry must be the largest amax of
the real uses, the value the unpipelined stack records. A Variable class that says
`combine_uses = "max"` marks such a leaf; the loop then hands every iteration its own
copy (`fan_out`: the leaf broadcast to [T, ...] and scanned over with the iterations),
whose backward pass is the max of the copies' cotangents over the iterations in which
the stage held real work. So bubble iterations (zero or stale buffers) never count, and
a repeat chunk that an iteration does not run (cotangent 0) is harmless to the max.
Statistics are non-negative (an amax is), so 0 is the max's neutral element.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def marked(weights) -> list[bool]:
  """One flag per leaf of `jax.tree.leaves(weights)`: is it a max-combined statistic."""
  flags = []
  for node in jax.tree.leaves(weights, is_leaf=lambda v: isinstance(v, nnx.Variable)):
    by_max = isinstance(node, nnx.Variable) and getattr(type(node), "combine_uses", "sum") == "max"
    flags += [by_max] * len(jax.tree.leaves(node))
  return flags


def busy(schedule) -> np.ndarray:
  """bool [T, S]: stage s runs a real work item k in [0, M*R) at iteration t."""
  k = schedule.item(np.arange(schedule.iterations)[:, None], np.arange(schedule.stages)[None, :])
  return (k >= 0) & (k < schedule.microbatches * schedule.repeats)


def fan_out(stats: list[jax.Array], working: np.ndarray) -> list[jax.Array]:
  """Each [S, ...] statistic as [T, S, ...], one copy per iteration; the backward pass
  gives each the max over iterations t of its copies' cotangents where working[t, s]."""
  def copies(leaves):
    return [jnp.broadcast_to(a, working.shape[:1] + a.shape) for a in leaves]

  @jax.custom_vjp
  def fan(leaves):
    return copies(leaves)

  def bwd(_, cts):
    mask = lambda ct: working.reshape(working.shape + (1,) * (ct.ndim - 2))
    return ([jnp.max(jnp.where(mask(ct), ct, jnp.zeros_like(ct)), axis=0) for ct in cts],)

  fan.defvjp(lambda leaves: (copies(leaves), None), bwd)
  return fan(list(stats))
