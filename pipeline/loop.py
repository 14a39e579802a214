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
example moves between devices.

Memory (per device; "a microbatch" = one microbatch's activation [rows, length,
embed] as the rules split it over data/model). The scan's carry is the stage
buffer [S, ...] (one microbatch per stage group) and, for R > 1, the circular
queue (circular.py: ceil((M-S)/S) microbatches per group when M >= 2S, M - S
otherwise, plus the one it passes on next iteration); with delay_shift, the shift
in flight (one more microbatch per group). The last M iterations' outputs [S, ...] go
into M slots of the carry (kept as T scan outputs, T = M*R + S - 1, they cost
moe.maverick_4slices 4.07 GiB more per chip), and the last stage's are taken once
after the loop: no iteration broadcasts anything to the other stage groups. Each
iteration's stage computation is wrapped in `jax.checkpoint`, so
the backward pass keeps only its input, the buffer (T microbatches per group),
and recomputes the stage's layers one iteration at a time; the model's own
per-block remat then bounds that one iteration's intermediates. Total: about
T + M microbatches per device (saved inputs, outputs) plus the inputs and their
cotangent (M per device),
whatever the layers per stage, against T x (L/(S*R) layer inputs or all their
intermediates) when the scan saved the stage body's residuals. Always, not only
with model.remat != 'none': without it the pipeline would save every
intermediate of every iteration, the memory pipelining is meant to spread out.
The price is one more forward of each stage in the backward pass (3 -> 4
forward-equivalents per step), and only one: `stage_remat` turns the model's
remat='full' into 'dots' inside the stage ('none' for a one-unit visit), so the
recomputed iteration keeps its matmul outputs and its backward redoes only
elementwise work (before: the block's own full remat recomputed every layer a
second time, 5 forward-equivalents); every other policy is mapped the same way or
refused by name (`_INNER_REMAT` below). With remat='offload' the T saved stage inputs
per group live in host memory instead, one brought back per iteration of the backward.
Bubble iterations compute on stale or zero buffers; their outputs are never
read as results and so add exactly zero to results and gradients. Running statistics
among the weights (the fp8 amax histories) get one copy per iteration whose uses
combine by max over the real work items, not by sum (statistics.py).
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.ad_checkpoint import checkpoint_name

from shardax.configs.pipeline import remat_refusal
from shardax.pipeline import statistics
from shardax.pipeline.circular import Queue
from shardax.pipeline.schedule import PipelineError, Schedule
from shardax.pipeline.stages import from_stages
from shardax.sharding import rules as rules_lib
from shardax.sharding import manual, shard

# (stacked weights of some layers, x, positions[, segment_ids]) -> x: runs those layers in
# order, so the same function runs one stage's L/(S*R) layers or, unpipelined, all L of them.
StageFn = Callable[..., jax.Array]


# Inside the pipeline's per-iteration checkpoint, the model's remat policy only decides
# what the one recomputed iteration keeps for its backward (`stage_remat`):
#   'none', 'dots'        as given;
#   'full'                'dots': 'full' there would recompute each layer a second time;
#   'dots_no_batch'       'dots': under the stage vmap every dot gets the stage as a batch
#                         dim, so it could not tell weight matmuls from attention products
#                         and would keep nothing;
#   'offload'             'dots', and the stage inputs the loop saves across iterations (the
#                         block inputs of a pipeline) are offloaded to host memory (`run`);
#   'moe_matmuls',        'none': they save the projections and expert matmuls so that no
#   'moe_returned'        matmul is recomputed, but inside the recomputed iteration the
#                         router and the dense MLPs would run a third time; keeping that one
#                         iteration whole recomputes nothing twice;
#   'offload_proj',       refused when the config is built (configs/pipeline.py).
#   'offload_qkv'
# A visit of one unit has no layer loop: there XLA merges the two recomputes of 'full' into
# one and keeps all of that one layer's intermediates, i.e. 'none', which also spares the
# elementwise recompute of 'dots' (8 simulated CPU devices, 8 layers, S=4, R=2, in-process
# A/B: 'dots' 4-6% slower than 'full' or 'none'); so every mapped policy but a chosen
# 'dots' runs as 'none' there.
_INNER_REMAT = {"full": "dots", "dots_no_batch": "dots", "offload": "dots",
                "moe_matmuls": "none", "moe_returned": "none"}
# Remat policies whose saved tensors go to host memory: in a pipeline, the saved stage inputs.
_OFFLOADS_STAGE_INPUTS = ("offload",)
STAGE_INPUT = "pipeline_stage_input"   # the checkpoint name of a stage's input in `run`


_IN_STAGE_BODY = contextvars.ContextVar("shardax_in_stage_body", default=False)


def in_stage_body() -> bool:
  """Whether the layers being traced run in a pipeline stage body, which `run` vmaps over the
  stages: every op there gets the stage as a batch dim (layers/moe_dispatch.py picks its
  grouped matmul by it: the TPU compiler refuses a ragged_dot with one)."""
  return _IN_STAGE_BODY.get()


def stage_remat(remat: str, units_per_visit: int) -> str:
  """The per-block remat policy to run inside a pipeline stage for the model's `remat`,
  when a stage visit runs `units_per_visit` units (L / (S*R)). A policy the pipeline refuses
  (configs/pipeline.py) raises PipelineError naming it."""
  refusal = remat_refusal(remat, stages=2)
  if refusal is not None:
    raise PipelineError(refusal)
  if remat in _INNER_REMAT and units_per_visit == 1:
    return "none"
  return _INNER_REMAT.get(remat, remat)


def offloads_stage_inputs(remat: str) -> bool:
  """Whether the model's `remat` puts the stage inputs the loop saves in host memory
  (`run(inputs_on_host=...)`)."""
  return remat in _OFFLOADS_STAGE_INPUTS


def mesh_axes_of(logical: str) -> str | tuple[str, ...] | None:
  """The mesh axis (or axes) the rules in force give a dim named `logical`, or None.

  None without a mesh, without rules, or on one device: then the stage dim is not
  split and the pipeline runs its stages one after another on every device.
  """
  return manual.layout((logical,)).spec[0] if manual.active() else None


def _check_data_split(rows: int, batch_axes: Sequence[str | None], m: int) -> None:
  """Each microbatch must still split evenly over the batch dim's mesh axes."""
  if rules_lib.allow_uneven():
    return
  batch = manual.layout(batch_axes[:1])
  axes, degree = batch.axes[0], batch.parts(0)
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


def layer_stats(per_iteration: Any, schedule: Schedule, units_per_visit: int) -> Any:
  """Each unit's statistics, averaged over the microbatches: [L, ...] per leaf.

  per_iteration: leaves [T, S, units_per_visit, ...], what every stage's visit returned at
  every iteration (bubble ones included). Unit l runs on stage s = (l // u) % S in repeat
  r = l // (S u) as unit l % u of its visit; microbatch m reaches it as item k = r*M + m,
  at iteration t = k + h*s (schedule.item). A static gather picks those T x S entries that
  are real work and the mean over m is what M accumulation microbatches average (the MoE
  balance statistics, trainer/step.py); the bubble's entries are never read, so they add
  nothing to results or gradients.
  """
  S, M, R, u = schedule.stages, schedule.microbatches, schedule.repeats, units_per_visit
  layer = np.arange(S * R * u)[:, None]
  s, r, unit = (layer // u) % S, layer // (S * u), layer % u
  t = r * M + np.arange(M)[None, :] + schedule.hop * s            # [L, M]
  s, unit = np.broadcast_to(s, t.shape), np.broadcast_to(unit, t.shape)
  return jax.tree.map(lambda a: jnp.mean(a[t, s, unit], axis=1), per_iteration)


def run(stage_fn: StageFn, weights: Any, x: jax.Array, positions: jax.Array,
        schedule: Schedule, x_axes: Sequence[str | None] = ("batch", "length", "embed"),
        segment_ids: jax.Array | None = None,
        weight_axes: Sequence[Sequence[str | None] | None] | None = None,
        with_stats: bool = False, inputs_on_host: bool = False) -> jax.Array | tuple[jax.Array, Any]:
  """x [B, ...] through S stages x R repeats of `stage_fn`; returns [B, ...].

  weights: pytree, every leaf [S, ...] (R = 1) or [S, R, ...] (see stages.py);
  stage_fn(w, x_mb, positions_mb) runs one stage's layers (`w` without the
  stage/repeat dims) on one microbatch; positions: int [B, length]. With packed
  documents, segment_ids int [B, length] too: then stage_fn(w, x_mb, positions_mb,
  segment_ids_mb). These per-row inputs travel beside the buffer: each iteration a
  stage reads the rows of the microbatch it holds (item k = t - s, microbatch k % M),
  so every stage, in every repeat, sees its microbatch's own positions and documents.
  A batch smaller than M (decoding) skips the schedule: all layers run in order.
  weight_axes: the logical names of each leaf of `weights` (in `jax.tree.leaves` order,
  stage/repeat dims included), or None. Each visit's weights are then constrained to their
  stored layout, which does nothing forward (a dynamic index keeps it) but makes each
  visit's weight gradient leave the stage body in that layout: split over `data` by a
  reduce-scatter. Without it the TPU partitioner all-reduces every visit's gradient in
  full and keeps a slice (GPT-3 175B on v4:8x8x8: 6 s of synchronous all-reduces a step).
  with_stats: stage_fn returns (x, stats), stats' leaves with a leading dim of the visit's
  units (an MoE unit's routing statistics, layers/blocks.py); then run returns (y, stats
  [L, ...] averaged over the microbatches: `layer_stats`).
  inputs_on_host: the stage inputs saved for the backward pass (one per iteration, the only
  activations the loop keeps) are offloaded to host memory ('pinned_host') in the forward
  pass and brought back one iteration at a time in the backward (model.remat='offload').
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
    side = (positions,) if segment_ids is None else (positions, segment_ids)
    return stage_fn(jax.tree.map(lambda a: from_stages(a, R), weights), x, *side)  # stats [L, ...]
  rows = schedule.check_batch(x.shape[0])
  state_axes = ("stage",) + tuple(x_axes)
  # The microbatches as a stage sees them (rows split over the batch's other axes, whole in
  # every stage group): where a pp_ preset splits the batch over the stages too
  # (rules.split_over_stages), the stage groups gather it here, once, not in the loop.
  with rules_lib.within_stage():
    _check_data_split(rows, x_axes, M)
    xs = split_microbatches(x, M, x_axes)
    # Per-row inputs of each microbatch [M, rows, length]: positions, and segment ids if packed.
    side = tuple(split_microbatches(a, M, tuple(x_axes[:a.ndim]))
                 for a in ((positions,) if segment_ids is None else (positions, segment_ids)))
  # Every stage group gets its own view of the inputs (a local broadcast of xs), so stage 0
  # picks its microbatch with no cross-stage traffic and the backward pass sums the
  # inputs' cotangent over the stages once, after the loop.
  xs_per_stage = shard(jnp.broadcast_to(xs[None], (S,) + xs.shape), ("stage", None) + tuple(x_axes))
  stage_ids = jnp.arange(S)
  first = (stage_ids == 0).reshape((S,) + (1,) * (xs.ndim - 1))
  queue = Queue(S, M, schedule.hop, x_axes) if R > 1 else None

  def one_stage(w, h, s, k):
    token = _IN_STAGE_BODY.set(True)
    try:
      with rules_lib.within_stage():   # the vmap puts this body's stage dim on `stage` itself
        return stage_body(w, h, s, k)
    finally:
      _IN_STAGE_BODY.reset(token)

  def stage_body(w, h, s, k):
    if R > 1:  # this stage's chunk for the repeat it is on (clipped in the bubble)
      r = jnp.clip(k // M, 0, R - 1)
      w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False), w)
    if weight_axes is not None:  # gradients in the stored layout (see `weight_axes` above)
      flat = [a if names is None or stat else shard(a, tuple(names)[len(lead):])
              for a, names, stat in zip(jax.tree.leaves(w), weight_axes, is_stat, strict=True)]
      w = jax.tree.unflatten(treedef, flat)
    y, stats = stage_fn(w, h, *s) if with_stats else (stage_fn(w, h, *s), {})
    return y.astype(h.dtype), stats

  all_stages = jax.vmap(one_stage, spmd_axis_name=mesh_axes_of("stage"))

  # Running statistics: one copy per iteration, combined by max over real work (statistics.py).
  leaves, treedef = jax.tree.flatten(weights)
  is_stat = statistics.marked(weights)
  stats = [a for a, s in zip(leaves, is_stat) if s]
  stats = statistics.fan_out(stats, statistics.busy(schedule)) if stats else []

  def weights_at(stats_t):
    it = iter(stats_t)
    return jax.tree.unflatten(treedef, [next(it) if s else a for a, s in zip(leaves, is_stat)])

  policy = _stage_inputs_to_host() if inputs_on_host else None   # None: save the inputs on device

  @functools.partial(jax.checkpoint, prevent_cse=False, policy=policy)
  def compute(w, buffer, t):  # saved for the backward pass: `buffer` alone (w is loop-invariant)
    buffer = checkpoint_name(buffer, STAGE_INPUT)
    k = schedule.item(t, stage_ids)  # the work item of each stage; outside [0, M*R) = bubble
    y, stats = all_stages(w, buffer, tuple(a[k % M] for a in side), k)
    return shard(y, state_axes), stats

  T = schedule.iterations

  def iteration(carry, per_iteration):
    (out, in_flight, waiting, last), (t, stats_t) = carry, per_iteration
    # The collective-permute: stage s-1's output -> stage s. Delayed, this iteration takes
    # what the last one sent and sends the last one's output on, beside `compute`.
    if schedule.delay_shift:
      into_stage, in_flight = in_flight, shard(jnp.roll(out, 1, axis=0), state_axes)
    else:
      into_stage = jnp.roll(out, 1, axis=0)
    enter = jax.lax.dynamic_index_in_dim(xs_per_stage, t % M, 1, keepdims=False)
    if R > 1:  # repeat r > 0: microbatch t % M comes back from the last stage
      due, waiting = queue.step(waiting, out, into_stage)
      enter = jnp.where(t < M, enter, due)
    buffer = shard(jnp.where(first, enter, into_stage), state_axes)
    out, unit_stats = compute(weights_at(stats_t), buffer, t)
    # Microbatch m leaves the last stage for good at iteration T - M + m: the last M
    # iterations' outputs are the results. They go into M slots of the carry (earlier
    # iterations write slot 0, which iteration T - M overwrites), not T scan outputs.
    last = jax.lax.dynamic_update_index_in_dim(last, out, jnp.clip(t - (T - M), 0, M - 1), 0)
    return (out, in_flight, waiting, shard(last, (None,) + state_axes)), unit_stats

  out = shard(jnp.zeros((S,) + xs.shape[1:], x.dtype), state_axes)
  last = shard(jnp.zeros((M, S) + xs.shape[1:], x.dtype), (None,) + state_axes)
  carry = (out, out if schedule.delay_shift else None, queue.init(xs) if queue else None, last)
  (_, _, _, outs), unit_stats = jax.lax.scan(iteration, carry, (jnp.arange(T), stats))
  outs = outs[:, S - 1]   # the last stage's
  with rules_lib.within_stage():
    outs = shard(outs, (None,) + tuple(x_axes))
  y = merge_microbatches(outs, x_axes)   # split over the stages too where the rules say so
  if not with_stats:
    return y
  units = jax.tree.leaves(weights)[0].shape[len(lead)]
  return y, layer_stats(unit_stats, schedule, units)


def _stage_inputs_to_host():
  """The per-iteration checkpoint's policy that keeps the stage input, in host memory."""
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=[STAGE_INPUT],
      offload_src="device", offload_dst="pinned_host")
