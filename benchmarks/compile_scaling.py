"""Compile time of one train step as the device count grows, 8 .. 2048 TPU v4 chips.

GSPMD's claim: the partitioner writes one program for every device, so compile
time does not grow with the device count. Here the same experiment (a 0.17B-param
LM, 2D sharding with model=8 and the data axis growing, per-device batch fixed:
weak scaling) is compiled ahead of time for v4 slices described by libtpu
(sharding/topology.py); nothing runs, so this works on a CPU machine.

  python benchmarks/compile_scaling.py                      # 8 .. 2048 chips
  python benchmarks/compile_scaling.py --counts 8,64 --exp pod.lm_16b

Prints devices, topology, mesh, trace+lower seconds, compile wall seconds and compile
CPU seconds (all threads; the fairer figure on a shared host) per count (and
`--json PATH` writes them), after one untimed warm-up compile (the first compile in a
process also starts the TPU compiler). Timings depend on the host's CPU and load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

V4_SLICES = {8: "v4:2x2x2", 16: "v4:2x2x4", 32: "v4:2x4x4", 64: "v4:4x4x4", 128: "v4:4x4x8",
             256: "v4:4x8x8", 512: "v4:8x8x8", 1024: "v4:8x8x16", 2048: "v4:8x16x16"}

# 8 layers x 16 d^2 (d=1024) + a 32k x 1024 embedding: 0.17B params.
BASE = ["data.source='synthetic'", "model.vocab_size=32768", "model.d_model=1024", "model.num_heads=16",
        "model.d_ff=4096", "model.num_layers=8", "model.max_len=1024", "data.seq_len=1024",
        "model.dtype='bfloat16'", "model.param_dtype='bfloat16'", "model.remat='full'",
        "sharding.preset='2d'"]


def compile_once(exp_name: str, count: int, per_data_batch: int, model_axis: int) -> dict:
  from shardax import configs
  from shardax.sharding import use_rules
  from shardax.perf import dry_run
  from shardax.trainer import step as step_lib
  import jax

  data = count // model_axis
  cfg = configs.get(exp_name)
  sets = (BASE if exp_name == "lm.tiny" else []) + [
      f"mesh.topology='{V4_SLICES[count]}'", f"mesh.ici=({data},{model_axis})",
      f"train.global_batch={per_data_batch * data}"]
  configs.apply_overrides(cfg, sets)
  exp = configs.build(cfg)
  mesh, setup = dry_run.prepare(exp)
  start = time.perf_counter()
  with jax.set_mesh(mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    lowered = step_lib.train_step_fn(setup).lower(setup.abstract, step_lib.abstract_batch(setup))
    traced, cpu_traced = time.perf_counter(), time.process_time()
    lowered.compile()
  done, cpu_done = time.perf_counter(), time.process_time()
  return {"devices": int(mesh.size), "topology": V4_SLICES[count], "mesh": dict(mesh.shape),
          "params": sum(int(x.size) for x in jax.tree.leaves(setup.abstract["params"])),
          "lower_seconds": traced - start, "compile_seconds": done - traced,
          "compile_cpu_seconds": cpu_done - cpu_traced}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--exp", default="lm.tiny", help="experiment (lm.tiny is resized to a 0.17B LM)")
  p.add_argument("--counts", default=",".join(map(str, V4_SLICES)), help="device counts")
  p.add_argument("--per_data_batch", type=int, default=4, help="sequences per data-axis index")
  p.add_argument("--model_axis", type=int, default=8, help="size of the model axis")
  p.add_argument("--json", default=None, help="also write the rows here")
  args = p.parse_args(argv)
  if bad := [c for c in args.counts.split(",") if int(c) not in V4_SLICES]:
    sys.exit(f"--counts: {bad} not among {sorted(V4_SLICES)}")
  rows = []
  counts = [int(c) for c in args.counts.split(",")]
  # The first compile in a process also starts the TPU compiler; keep that out of the figures.
  # (A different batch size, so that jax's in-memory cache cannot serve the first timed row.)
  compile_once(args.exp, counts[0], 2 * args.per_data_batch, args.model_axis)
  print(f"{'devices':>8} {'topology':<12} {'mesh':<28} {'lower s':>8} {'compile s':>10} {'CPU s':>8}",
        flush=True)
  for count in counts:
    r = compile_once(args.exp, count, args.per_data_batch, args.model_axis)
    rows.append(r)
    print(f"{r['devices']:>8} {r['topology']:<12} {str(r['mesh']):<28} {r['lower_seconds']:>8.1f} "
          f"{r['compile_seconds']:>10.1f} {r['compile_cpu_seconds']:>8.1f}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
