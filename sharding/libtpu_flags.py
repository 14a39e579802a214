"""TPU compiler flags an experiment asks for (`mesh.libtpu_flags`), set before libtpu loads.

libtpu reads `LIBTPU_INIT_ARGS` once, when the process first loads it (jax's platform
probe at start-up, or the first topology description), so the CLI applies an experiment's
flags before it touches a backend; later changes in the same process do nothing.
A flag the user already put in `LIBTPU_INIT_ARGS` keeps the user's value.

`ASYNC_WEIGHT_GATHER` is for programs that gather weights inside a loop (the `pp_2d`
pipeline re-gathers each stage's weights over `data` every iteration). This libtpu
writes those all-gathers synchronously unless asked; with this flag the compiled
v4 program has `all-gather-start`/`-done` pairs with the stage body's matmuls between
them (tests/test_pipeline.py), which the step model then counts as hidden under that
compute. Only the default compile effort shows the overlap: at effort -1 (jax's O0) the
TPU scheduler keeps every collective synchronous whatever the flags, so a dry run that
should price it compiles at effort 0. What each flag set did to the pipelined GPT-3's
predicted step is in docs/results/pipeline.md.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Sequence

ASYNC_WEIGHT_GATHER = ("--xla_enable_async_all_gather=true",)
# MaxText's v5p set: async all-gathers fused with compute. It makes part of moe.mixtral_8x7b's
# expert-weight gathers async (docs/results/moe_pods.md); on the pipelined GPT-3 its compute
# fusions read more HBM and the step got slower (docs/results/pipeline.md).
ASYNC_COLLECTIVE_FUSION = ("--xla_tpu_enable_async_collective_fusion=true",
                           "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
                           "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
                           "--xla_tpu_overlap_compute_collective_tc=true",
                           "--xla_enable_async_all_gather=true")

# All-to-alls as start/done pairs that matmuls can run between (v5p writes them synchronous
# by default; ragged-all-to-all stays synchronous either way): the dropless MoE exchange in
# pieces (`model.moe.dispatch_chunks`), tests/test_moe_overlap.py.
ASYNC_ALL_TO_ALL = ("--xla_tpu_enable_async_all_to_all=true",)


class LibtpuFlagError(ValueError):
  pass


def _name(flag: str) -> str:
  if not flag.startswith("--") or len(flag) < 3:
    raise LibtpuFlagError(f"mesh.libtpu_flags: {flag!r} is not a flag; write it as "
                          f"'--name=value', e.g. {ASYNC_WEIGHT_GATHER[0]!r}")
  return flag[2:].split("=", 1)[0]


def check(flags: Sequence[str]) -> None:
  """Raises LibtpuFlagError naming a malformed entry of mesh.libtpu_flags."""
  if isinstance(flags, str):
    raise LibtpuFlagError(f"mesh.libtpu_flags={flags!r} must be a tuple of flags, e.g. {ASYNC_WEIGHT_GATHER!r}")
  for f in flags:
    _name(f)


def apply(flags: Sequence[str], environ: MutableMapping[str, str] = os.environ) -> str:
  """Appends `flags` to LIBTPU_INIT_ARGS, except those the user already set; returns it."""
  current = environ.get("LIBTPU_INIT_ARGS", "").split()
  named = {_name(f) for f in current if f.startswith("--")}
  added = [f for f in flags if _name(f) not in named]
  if added:
    environ["LIBTPU_INIT_ARGS"] = " ".join(current + added)
  return environ.get("LIBTPU_INIT_ARGS", "")
