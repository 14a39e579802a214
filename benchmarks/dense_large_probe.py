"""The Llama-3.1-70B 8k row kept aside (benchmarks/heldout_runs.json), shrunk to a program this
machine compiles in minutes, priced term by term at the row's depth (docs/results/dense_large_pricing.md).

    python benchmarks/dense_large_probe.py [--hlo PATH] [--layers 3]

The row's layout (FSDP), remat (layer input and q/k/v offloaded to host), sequence and flash
kernel are kept; the widths shrink (d 1024, 8 heads of 128, 2 kv heads, d_ff 4096, vocab
32768), the slice to v6e:2x2 with 2 sequences a chip, and the row's libtpu flags are left
out. The 3-layer copy is compiled (or its program read from --hlo, where a compile keeps it)
and deepened to 80 layers through the calibration's path (`calibrate.cache_entry`,
`predict_row`). Run it with another tree on PYTHONPATH to price the same program with that
tree's step model (the before/after of the results file).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def probe_row() -> dict:
  rows = json.load(open(os.path.join(HERE, "heldout_runs.json")))
  r = copy.deepcopy(next(r for r in rows if r["id"] == "tpu-recipes-llama3.1-70b-8k-v6e-128"))
  r["id"] = "probe-70b-shaped-v6e-4"
  r["training"].pop("libtpu_flags", None)
  r["model"].update(d_model=1024, num_heads=8, num_kv_heads=2, head_dim=128, d_ff=4096, vocab_size=32768)
  r["hardware"].update(chips_per_slice=4, total_chips=4)
  r["training"].update(seq_len=2048, global_batch_seqs=8)
  r["sharding"]["ici"] = {"data": 1, "fsdp": 4, "tensor": 1}
  return r


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hlo", default="", help="a kept program of the shallow copy (else compile it and keep it here)")
  p.add_argument("--layers", type=int, default=3)
  a = p.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import shardax
  sys.path.insert(0, os.path.join(os.path.dirname(shardax.__file__), "benchmarks"))   # that tree's calibrate
  import calibrate
  row = probe_row()
  if a.hlo and os.path.exists(a.hlo):
    hlo = open(a.hlo).read()
  else:
    from shardax.perf import dry_run
    hlo = dry_run.compile_step(dry_run.prepare(calibrate._build(row, a.layers))[1]).as_text()
    if a.hlo:
      open(a.hlo, "w").write(hlo)
  entry = calibrate.cache_entry(row, a.layers, hlo, cache=tempfile.mkdtemp())
  pr = calibrate.predict_row(row, entry)
  b, c = pr.breakdown, pr.breakdown["collectives"]
  print(json.dumps({"tree": os.path.dirname(shardax.__file__), "step": pr.step_seconds, "compute": b["compute_seconds"],
                    "memory": b["memory_seconds"], "exposed": c["exposed_seconds"], "hidden": c["hidden_seconds"],
                    "flash_kernel": b.get("flash_kernel_seconds", 0.0), "host_transfer": b.get("host_transfer"),
                    "recompute_factor": b["recompute_factor"],
                    "loops": [(l["body"], l["trip_count"]) for l in entry["costs"]["loops"]]}, indent=1))
  for piece in sorted(b["pieces"], key=lambda q: -q["executions"] * q["seconds_each"])[:4]:
    print(f"  {piece['computation'][:50]:50s} x{piece['executions']:3d}: {piece['seconds_each'] * 1e3:.3f} ms each "
          f"(compute {piece['compute_seconds_each'] * 1e3:.3f}, memory {piece['memory_seconds_each'] * 1e3:.3f}, "
          f"collectives {piece['collective_seconds_each'] * 1e3:.3f})")


if __name__ == "__main__":
  main()
