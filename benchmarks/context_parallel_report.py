"""What context parallelism adds to a compiled train step, on a TPU topology from this CPU.

Compiles (AOT, libtpu) the train step of an LM for each `model.context_parallel` mode
with the `dp_cp` preset, and prints per-device memory and the collectives grouped by
kind, mesh axes of their groups and origin: inside the attention's shard_map (what
context parallelism adds), the batch reorder, or the rest (gradient reductions).
Counts and bytes are per step, loops unrolled.

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/context_parallel_report.py \\
      [--set PATH=VALUE ...]   (defaults: lm.small at 16384 tokens on v5e:2x4, data 2 x context 4)
"""

import collections
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from shardax import configs  # noqa: E402
from shardax.sharding import report  # noqa: E402
from shardax.perf import dry_run  # noqa: E402

BASE = ["mesh.topology='v5e:2x4'", "mesh.axes=('data','context')", "mesh.ici=(2,4)",
        "sharding.preset='dp_cp'", "train.global_batch=2", "data.source='synthetic'",
        "data.seq_len=16384", "model.max_len=16384", "model.remat='full'"]


def origin(op_name: str) -> str:
  if "shard_map" in op_name:
    return "attention (shard_map)"
  if "_take" in op_name:
    return "balanced reorder"
  return "other"


def measure(mode: str, extra: list[str]) -> None:
  cfg = configs.get("lm.small")
  configs.apply_overrides(cfg, BASE + extra + [f"model.context_parallel={mode!r}"])
  exp = configs.build(cfg)
  _, setup = dry_run.prepare(exp)
  compiled = dry_run.compile_step(setup)
  mem = report.memory(compiled)
  print(f"== model.context_parallel={mode!r}: mesh {dict(setup.mesh.shape)}, "
        f"temp {mem.get('temp_bytes', 0) / 2**30:.2f} GiB, peak {mem.get('peak_estimate_bytes', 0) / 2**30:.2f} GiB per device")
  rows = collections.defaultdict(lambda: [0, 0])
  for c in report.collectives(compiled.as_text()):
    key = (origin(c.op_name), c.kind, c.group_size)
    rows[key][0] += c.executions
    rows[key][1] += c.bytes * c.executions
  print(f"  {'origin':<24}{'kind':<20}{'group':>6}{'count':>7}{'bytes/step':>16}")
  for (where, kind, group), (count, nbytes) in sorted(rows.items()):
    print(f"  {where:<24}{kind:<20}{group:>6}{count:>7}{nbytes:>16,}")


def main(argv: list[str]) -> None:
  extra = [a for a in argv if a != "--set"]
  for mode in ("allgather", "ring"):
    measure(mode, extra)


if __name__ == "__main__":
  main(sys.argv[1:])
