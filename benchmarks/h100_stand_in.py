"""The step model's H100 pricing against the one H100 step we measured ourselves: lm.1b
(docs/performance.md "On one H100 GPU", MEASURED_SECONDS), compiled for one TPU v5p chip
(a stand-in: the GPU compiler is not here) and priced as the H100, with and without the
traffic of matmul-free kernels counted apart (perf/kernels.py).

    PYTHONPATH=... JAX_PLATFORMS=cpu python benchmarks/h100_stand_in.py   # ~75 s compile on 2 cores
    PYTHONPATH=... python benchmarks/h100_stand_in.py --terms             # the A3 rows, term by term

The stand-in runs the splash kernel where the GPU ran cuDNN flash attention (priced at the
H100's measured flash rate, as the calibration's H100 rows are). `--terms` prices the cached
H100 calibration rows (benchmarks/calibration/) with each GPU term switched off in turn: the
matmul-free kernels' traffic (hidden under the matmuls) and the stand-in's cross-slice
transfers (overlapped where the TPU schedule overlaps them: `stepmodel._overlaps` as for a TPU)."""

from __future__ import annotations

import dataclasses
import json
import time

MEASURED_SECONDS = 0.5175   # docs/performance.md, lm.1b on one H100 SXM, median of 20 steps


def main():
  from shardax import configs
  from shardax.perf import costs as costs_lib, dry_run, hardware, mxu, stepmodel
  exp = configs.resolve("lm.1b", ["mesh.topology='v5p:1x1x1'", "model.attention='flash'",
                                  "data.source='synthetic'"])
  mesh, setup = dry_run.prepare(exp)
  start = time.perf_counter()
  hlo = dry_run.compile_step(setup).as_text()
  seconds = time.perf_counter() - start
  cost = costs_lib.of_hlo_text(hlo)
  h100 = hardware.lookup("NVIDIA H100 80GB HBM3")
  price = lambda c: stepmodel.from_costs(c, mesh, exp, h100, mxu.by_piece(hlo, c.owner),
                                         flash_kernel=stepmodel.runs_flash_kernel(hlo))
  now = price(cost)
  hidden = price(dataclasses.replace(cost, pieces=tuple(dataclasses.replace(p, matmul_free_bytes=0.0)
                                                        for p in cost.pieces)))
  b = now.breakdown
  print(json.dumps({
      "compile_seconds": round(seconds, 1), "measured_step": MEASURED_SECONDS,
      "predicted_step": round(now.step_seconds, 4), "ratio": round(now.step_seconds / MEASURED_SECONDS, 3),
      "predicted_with_matmul_free_traffic_hidden": round(hidden.step_seconds, 4),
      "ratio_hidden": round(hidden.step_seconds / MEASURED_SECONDS, 3),
      "compute_seconds": round(b["compute_seconds"], 4), "memory_seconds": round(b["memory_seconds"], 4),
      "matmul_free_seconds": round(sum(p.executions * p.matmul_free_bytes for p in cost.pieces)
                                   / h100.hbm_bandwidth, 4),
      "flash_kernel_seconds": round(b.get("flash_kernel_seconds", 0.0), 4)}, indent=1))


def terms():
  import os
  import sys
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import calibrate
  from shardax.perf import hardware, stepmodel
  rows = [r for r in json.load(open(calibrate.RUNS)) if r["id"].startswith("maxtext-a3-")]
  exposed, tpu = stepmodel._overlaps, hardware.lookup("TPU v5")
  as_tpu_schedule = lambda c, chip: exposed(c, tpu)   # the TPU schedule's overlap, on any chip
  print("| row | published | neither | matmul-free traffic only | cross-VM exposed only | both (now) |")
  print("|---|---:|---:|---:|---:|---:|")
  for row in rows:
    entry = json.load(open(os.path.join(calibrate.CACHE, f"{row['id']}.json")))
    pub, cells = calibrate._published(row), []
    for free, dcn in ((False, False), (True, False), (False, True), (True, True)):
      e = json.loads(json.dumps(entry))
      for p in e["costs"]["pieces"] if not free else ():
        p["matmul_free_bytes"] = 0.0
      stepmodel._overlaps = exposed if dcn else as_tpu_schedule
      try:
        step = calibrate.predict_row(row, e).step_seconds
      finally:
        stepmodel._overlaps = exposed
      cells.append(f"{step:.3f} s ({step / pub:.2f}x)")
    print(f"| {row['id']} | {pub:.3f} s | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  import sys
  terms() if "--terms" in sys.argv[1:] else main()
