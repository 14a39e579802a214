"""Pipeline step time against microbatches M and circular repeats R, next to the bubble.

    python benchmarks/pipeline_bubble.py                  # S=4 stages on (stage=4, data=2)
    python benchmarks/pipeline_bubble.py --stages 2 --rounds 5

Every pipeline iteration runs all S stages (bubble stages compute on stale data),
so a pipelined step costs (M*R + S - 1) iterations of 1/(M*R) of the useful work:

    t_pipe(M, R) = t_useful / (1 - bubble),   bubble = (S - 1) / (M*R + S - 1).

t_useful is measured on the same work without the pipeline: the same model and
batch, unpipelined, in one pass, with `model.remat=full`, on the data-parallel devices
of one stage group (data=2 devices). The pipeline wraps every iteration's stage
computation in `jax.checkpoint`, so its backward recomputes each stage's forward once:
forward + recomputed forward + backward, exactly what `remat=full` does per block. So
one fixed baseline serves every (M, R): the same FLOPs, nothing to wait for. (An
earlier baseline used `train.microbatches=M` gradient accumulation and no remat: less
work than the pipeline, and a cost that grew with M, so it could report efficiencies
above 1 - bubble.) What the pipeline still pays beyond the bubble: M smaller matmuls
per stage instead of one, the collective-permutes, and a per-iteration overhead.

On the simulated 8-device CPU mesh all devices share the host's cores, so wall time
counts every device's work, which is what a real pipeline's step time counts per
stage; collective-permutes are memory copies here. Printed per row: measured step
seconds (median over rounds, configs timed round-robin so host load hits all alike),
t_useful/t_pipe (measured efficiency) and 1 - bubble (predicted efficiency; measured
can only be lower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MODEL = ["data.source='synthetic'", "model.num_layers=8", "model.d_model=64", "model.num_heads=4",
         "model.d_ff=256", "model.max_len=64", "data.seq_len=64", "train.global_batch=32"]


def step_fn(sets: list[str], devices):
  """A compiled (params, batch) -> (loss, grads) for the experiment lm.tiny + `sets`."""
  import jax
  import numpy as np
  from shardax import configs
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import state as state_lib
  from shardax.trainer import step as step_lib

  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, MODEL + sets)
  exp = configs.build(cfg)
  mesh = make_mesh(exp.mesh, devices)
  setup = state_lib.create(exp, mesh)
  fn = jax.jit(lambda p, b: step_lib.grads_and_loss(setup, p, b)[:2],
               in_shardings=(setup.shardings["params"], setup.batch_sharding),
               out_shardings=(setup.replicated, setup.shardings["params"]))
  tokens = np.random.default_rng(0).integers(1, 256, size=(exp.train.global_batch, exp.data.seq_len + 1))
  batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
  with jax.set_mesh(mesh), use_rules(setup.rules):
    params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
    batch = jax.device_put(batch, setup.batch_sharding)
    compiled = fn.lower(params, batch).compile()
  run = lambda: jax.block_until_ready(compiled(params, batch))
  run()  # warm up
  return run


def time_round_robin(runs: dict, rounds: int, steps: int) -> dict[str, float]:
  times: dict = {k: [] for k in runs}
  for _ in range(rounds):
    for k, run in runs.items():
      t = time.perf_counter()
      for _ in range(steps):
        run()
      times[k].append((time.perf_counter() - t) / steps)
  return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--stages", type=int, default=4)
  p.add_argument("--configs", default="4x1,8x1,16x1,4x2,8x2", help="MxR pairs")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=2, help="steps per config per round")
  args = p.parse_args()

  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from shardax import pipeline

  S, data = args.stages, 8 // args.stages
  pairs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
  runs = {}
  for m, r in pairs:
    runs[("pipe", m, r)] = step_fn([
        f"model.pipeline.stages={S}", f"model.pipeline.microbatches={m}",
        f"model.pipeline.circular_repeats={r}", "mesh.axes=('stage', 'data')",
        f"mesh.ici=({S}, {data})", "sharding.preset='pp_dp'"], jax.devices())
  runs["useful"] = step_fn(["model.remat='full'", "mesh.axes=('data',)", f"mesh.ici=({data},)",
                            "sharding.preset='dp'"], jax.devices()[:data])
  t = time_round_robin(runs, args.rounds, args.steps)

  print(f"lm.tiny 8 layers d_model 64, batch 32 x 64 tokens; {S} stages on (stage={S}, data={data}) "
        f"of 8 simulated CPU devices on {os.cpu_count()} cores; fwd+bwd step, median of {args.rounds}; "
        f"t_useful: the same model and batch unpipelined with remat=full on (data={data})")
  print(f"{'M':>3} {'R':>2} {'iters':>5} {'bubble':>7} {'t_pipe s':>9} {'t_useful s':>10} "
        f"{'measured eff':>12} {'predicted eff':>13} {'t / t(M=' + str(pairs[0][0]) + ',R=1)':>16} "
        f"{'predicted':>9}")
  base_m, base_r = pairs[0]
  base_b = pipeline.bubble_fraction(S, base_m, base_r)
  for m, r in pairs:
    sched = pipeline.Schedule(S, m, r)
    tp, tu = t[("pipe", m, r)], t["useful"]
    rel, rel_pred = tp / t[("pipe", base_m, base_r)], (1 - base_b) / (1 - sched.bubble_fraction)
    print(f"{m:>3} {r:>2} {sched.iterations:>5} {sched.bubble_fraction:>7.3f} {tp:>9.4f} {tu:>10.4f} "
          f"{tu / tp:>12.3f} {1 - sched.bubble_fraction:>13.3f} {rel:>16.3f} {rel_pred:>9.3f}")


if __name__ == "__main__":
  main()
