"""The pipelined step before and after a change, side by side on 8 simulated CPU devices.

    git archive <old commit> | tar -x -C /tmp/old/shardax      # the old package, importable
    python benchmarks/pipeline_old_new.py --old /tmp/old --new /path/holding/shardax --rounds 3

Each round runs one process per (tree, config) in turn, old then new, so host load
hits both alike; each process compiles the forward+backward step of
benchmarks/pipeline_bubble.py's model (8 layers, d_model 64, batch 32 x 64 tokens,
4 stages on (stage=4, data=2)) and times `--steps` steps after a warm-up. Printed:
the median step seconds of each tree over all rounds and new / old (below 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(sets: list[str], steps: int) -> None:
  import time
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  sys.path.insert(0, HERE)
  from pipeline_bubble import step_fn
  run = step_fn(sets, jax.devices())
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    run()
    times.append(time.perf_counter() - t)
  print(json.dumps(times))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--old", required=True, help="a folder holding the old tree as `shardax/`")
  p.add_argument("--new", required=True, help="a folder holding the new tree as `shardax/`")
  p.add_argument("--configs", default="8x2:full,8x1:none", help="MxR:remat, comma-separated")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    return child(json.loads(args.child), args.steps)
  times: dict = {}
  for _ in range(args.rounds):
    for config in args.configs.split(","):
      mr, remat = config.split(":")
      m, r = mr.split("x")
      sets = [f"model.pipeline.stages=4", f"model.pipeline.microbatches={m}",
              f"model.pipeline.circular_repeats={r}", f"model.remat={remat!r}",
              "mesh.axes=('stage', 'data')", "mesh.ici=(4, 2)", "sharding.preset='pp_dp'"]
      for tree, path in (("old", args.old), ("new", args.new)):
        # `path` first: its `shardax` wins over one later on PYTHONPATH (benchmarks/gpu_env.sh
        # puts the checkout and the dependencies there on the GPU machine).
        pythonpath = os.pathsep.join([path] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        env = dict(os.environ, PYTHONPATH=pythonpath, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
        out = subprocess.run([sys.executable, __file__, "--old", args.old, "--new", args.new,
                              "--steps", str(args.steps),
                              "--child", json.dumps(sets)], env=env, capture_output=True, text=True,
                             check=True, cwd="/")
        times.setdefault((config, tree), []).extend(json.loads(out.stdout.strip().splitlines()[-1]))
  print(f"{'config (MxR:remat)':<20} {'old s':>8} {'new s':>8} {'new/old':>8}  (median of {args.rounds} x "
        f"{args.steps} steps, 4 stages on (stage=4, data=2), {os.cpu_count()} cores)")
  for config in args.configs.split(","):
    old, new = (statistics.median(times[(config, t)]) for t in ("old", "new"))
    print(f"{config:<20} {old:>8.4f} {new:>8.4f} {new / old:>8.3f}")


if __name__ == "__main__":
  main()
