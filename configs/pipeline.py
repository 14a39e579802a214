"""The pipeline part of an LM config: `TransformerConfig(..., pipeline=PipelineConfig(...))`,
set by path (`--set model.pipeline.stages=4`). The loop that runs it is pipeline/loop.py; its
schedule and bubble, pipeline/schedule.py."""

from __future__ import annotations

import dataclasses

from shardax.configs.errors import require as _require

# model.remat choices a pipeline refuses, with why (pipeline/loop.py `stage_remat` maps every
# other one to what it means inside a stage). The pipeline's per-iteration checkpoint keeps
# only each stage's input across iterations, so what a policy parks on the host beyond the
# block input lives one iteration and its round trip buys nothing.
_PROJECTIONS_ON_HOST = ("inside a pipeline each iteration's stage is recomputed from its saved input "
                       "alone, so projections offloaded to host would only travel there and back "
                       "within that one iteration's backward")
REMAT_REFUSED_IN_PIPELINE = {"offload_proj": _PROJECTIONS_ON_HOST, "offload_qkv": _PROJECTIONS_ON_HOST}


def remat_refusal(remat: str, stages: int) -> str | None:
  """The error for `model.remat=remat` in a pipeline of `stages` stages, or None when it runs.
  Names the field, the reason and the policies to use instead."""
  why = REMAT_REFUSED_IN_PIPELINE.get(remat) if stages > 1 else None
  if why is None:
    return None
  return (f"model.remat={remat!r} with model.pipeline.stages={stages}: {why}; use "
          f"model.remat='offload' (the saved stage inputs go to host memory) or model.remat='full'")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Pipeline parallelism over the layer stack (stages=1 means no pipeline)."""
  stages: int = 1
  microbatches: int = 1
  circular_repeats: int = 1
  # Stage s takes what stage s-1 made two iterations ago, so the shift runs beside the stage
  # body instead of between iterations; the bubble doubles (pipeline/schedule.py).
  delay_shift: bool = False
  # Each visit's weight gradients leave the stage body in the weights' stored layout: with
  # weights split over `data` (pp_2d) a reduce-scatter per visit instead of a full all-reduce
  # (pipeline/loop.py `weight_axes`). The TPU compilers differ on which is cheaper (v4 faster,
  # v5e slower): docs/results/pipeline.md has the measurements.
  grads_in_layout: bool = True

  def __post_init__(self):
    for f in ("stages", "microbatches", "circular_repeats"):
      _require(getattr(self, f) >= 1, f"model.pipeline.{f}={getattr(self, f)} must be >= 1")
    _require(self.stages > 1 or (self.microbatches == 1 and self.circular_repeats == 1
                                 and not self.delay_shift and self.grads_in_layout),
             f"model.pipeline.microbatches={self.microbatches} / circular_repeats="
             f"{self.circular_repeats} / delay_shift={self.delay_shift} / grads_in_layout="
             f"{self.grads_in_layout} do nothing without a pipeline (stages=1); set "
             f"model.pipeline.stages > 1, or use train.microbatches for gradient accumulation")
    _require(self.circular_repeats == 1 or self.microbatches >= self.stages,
             f"model.pipeline.microbatches={self.microbatches} < stages={self.stages}: the circular "
             f"schedule (circular_repeats={self.circular_repeats}) needs microbatches >= stages; "
             f"raise microbatches or set circular_repeats=1")
    _require(not self.delay_shift or self.circular_repeats == 1 or self.microbatches >= 2 * self.stages,
             f"model.pipeline.microbatches={self.microbatches} < 2 x stages={2 * self.stages}: the "
             f"circular schedule with delay_shift=True needs microbatches >= 2 x stages; raise "
             f"microbatches, or set delay_shift=False")
