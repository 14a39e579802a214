"""Pipeline parallelism as sharding: stage-stacked weights, a vmapped stage body, a shifting buffer.

  schedule.py  which stage runs what at each iteration; bubble (S-1)/(M*R+S-1); errors
  stages.py    weights [L, ...] <-> [S, (R,) L/(S*R), ...] with `stage` as the first logical dim
  loop.py      the M*R + S - 1 iteration scan over microbatches (`run`); memory in its docstring
  circular.py  the queue where a microbatch waits between repeats (R > 1), split over stages
"""

from shardax.pipeline.loop import (in_stage_body, layer_stats, mesh_axes_of, offloads_stage_inputs, run,
                                   stage_remat)
from shardax.pipeline.schedule import PipelineError, Schedule, bubble_fraction
from shardax.pipeline.stages import (from_stages, restack_module, stage_axes, stage_params,
                                     to_stages, unstage_params)

__all__ = ["PipelineError", "Schedule", "bubble_fraction", "from_stages", "in_stage_body", "layer_stats", "mesh_axes_of",
           "offloads_stage_inputs", "restack_module", "run", "stage_axes", "stage_remat", "stage_params",
           "to_stages", "unstage_params"]
