"""mesh.libtpu_flags (sharding/libtpu_flags.py): what the CLI adds to LIBTPU_INIT_ARGS, and
what ASYNC_WEIGHT_GATHER does to a pp_2d pipeline's per-iteration weight gathers on TPU."""

import json
import os
import subprocess
import sys

import pytest

from shardax.sharding import libtpu_flags
from shardax.sharding.mesh import MeshConfig


def test_apply_adds_the_flags_and_keeps_the_users_own_values():
  env = {"LIBTPU_INIT_ARGS": "--xla_enable_async_all_gather=false --other=1"}
  out = libtpu_flags.apply(libtpu_flags.ASYNC_WEIGHT_GATHER + ("--third=2",), env)
  assert out.split() == ["--xla_enable_async_all_gather=false", "--other=1", "--third=2"]
  assert libtpu_flags.apply(libtpu_flags.ASYNC_WEIGHT_GATHER, {}).split() == list(libtpu_flags.ASYNC_WEIGHT_GATHER)
  unset = {}
  libtpu_flags.apply((), unset)
  assert "LIBTPU_INIT_ARGS" not in unset


def test_a_malformed_flag_is_refused_by_name():
  with pytest.raises(libtpu_flags.LibtpuFlagError, match="mesh.libtpu_flags: 'xla_enable_async_all_gather'"):
    MeshConfig(libtpu_flags=("xla_enable_async_all_gather",))
  with pytest.raises(libtpu_flags.LibtpuFlagError, match="must be a tuple"):
    MeshConfig(libtpu_flags="--xla_enable_async_all_gather=true")


# One TPU compile per process: libtpu reads LIBTPU_INIT_ARGS once, when it loads.
SCRIPT = r"""
import json, sys
from shardax import configs
from shardax.sharding import libtpu_flags
from shardax.perf import hardware, costs as costs_lib, dry_run, stepmodel
cfg = configs.get("lm.tiny")
configs.apply_overrides(cfg, [
    "data.source='synthetic'", "model.num_layers=4", "model.d_model=512", "model.num_heads=4",
    "model.d_ff=2048", "data.seq_len=256", "model.max_len=256", "train.global_batch=32",
    "model.pipeline.stages=2", "model.pipeline.microbatches=4",
    "mesh.axes=('stage','data','model')", "mesh.ici=(2,4,1)", "mesh.topology='v4:2x2x2'",
    "mesh.num_cpu_devices=None", "sharding.preset='pp_2d'", "mesh.libtpu_flags=" + sys.argv[1]])
exp = configs.build(cfg)
libtpu_flags.apply(exp.mesh.libtpu_flags)   # as the CLI does, before libtpu loads
mesh, setup = dry_run.prepare(exp)
costs = costs_lib.of_compiled(dry_run.compile_step(setup))
# The stage weights' gathers over `data` (group 4) inside the pipeline loop; norms' scales
# (2 KB) left out: nothing to gain from them.
g = [c for c in costs.collectives if c.kind == "all-gather" and c.executions > 1
     and c.group_size == 4 and c.bytes >= 1 << 16]
pr = stepmodel.from_costs(costs, mesh, exp, hardware.lookup(mesh.devices.flat[0].device_kind))
print(json.dumps({"gathers": [[c.is_async, c.compute_between] for c in g],
                  "exposed": pr.breakdown["collectives"]["exposed_seconds"]}))
"""


def _compile(flags: tuple[str, ...]) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("LIBTPU_INIT_ARGS", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # a cached program may predate the flags
  out = subprocess.run([sys.executable, "-c", SCRIPT, repr(flags)], env=env, capture_output=True,
                       text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow   # two TPU compiles in subprocesses: ~45-65 s each on the loaded 2-core host
def test_async_weight_gather_overlaps_the_stage_weights_gathers_on_tpu():
  """v4:2x2x2, pp_2d pipeline (stage=2, data=4): without the flags every per-iteration
  gather of the stage weights over `data` is a synchronous all-gather; with
  ASYNC_WEIGHT_GATHER each is an all-gather-start/-done pair with compute between, and
  the step model exposes less collective time."""
  pytest.importorskip("libtpu")
  sync, overlapped = _compile(()), _compile(libtpu_flags.ASYNC_WEIGHT_GATHER)
  assert sync["gathers"] and not any(a for a, _ in sync["gathers"]), sync
  assert len(overlapped["gathers"]) == len(sync["gathers"])
  assert all(a and between > 0 for a, between in overlapped["gathers"]), overlapped
  assert overlapped["exposed"] < sync["exposed"]
