"""Where the predicted step goes, per row and chip family, and what the compiler did.

    PYTHONPATH=... python benchmarks/chip_breakdown.py [--rows ID,ID] [--on v5e,v6e] [--compile]

For each calibration row (published-runs/calibration.json, the rows benchmarks/calibrate.py
compiles and caches) it prints the predicted step split into compute, HBM, ICI, DCN and
exposed collectives, the MXU utilization of the program's dot shapes (perf/mxu.py)
and the compiled program's structure (perf/program.py: fusions, dots, collectives
by kind, how many async, bytes per step). `--on GEN` also prices each row's model on another
chip generation: the same model, per-device batch and tensor parallelism, on one
`GEN:16x16` slice of 256 chips with FSDP over the rest (a Pax/MaxText-style dense layout),
compiled for that topology with libtpu, 3 layers deepened as the calibration does, and
cached under benchmarks/calibration/retargeted/. Only shapes come from the rows; no published
step time of the target chip is read. Rows whose cache lacks the program summary (compiled
before it was read) print '-' for it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import calibrate  # noqa: E402  (the calibration's compile/predict path, reused)

RETARGETED = os.path.join(calibrate.CACHE, "retargeted")
_NAMES = {"v5e": "TPU v5e", "v6e": "TPU v6e", "v5p": "TPU v5p", "v4": "TPU v4"}


def retarget(row: dict, gen: str, chips: int = 256, per_device: int | None = None) -> dict:
  """`row`'s model on one `gen` slice of `chips` chips: tensor parallelism kept, FSDP over the
  rest, the published per-device batch or `per_device` (the global batch scales with the chips)."""
  if gen not in _NAMES:
    raise ValueError(f"--on {gen!r}: known generations {', '.join(_NAMES)}")
  r = copy.deepcopy(row)
  tensor = int((r["sharding"].get("ici") or {}).get("tensor", 1) or 1)
  per_device = per_device or r["training"]["per_device_batch"]
  r["id"] = f"{row['id']}@{gen}-{chips}" + (f"-b{per_device}" if per_device != r["training"]["per_device_batch"] else "")
  r["hardware"].update(accelerator=_NAMES[gen], chips_per_slice=chips, num_slices=1, total_chips=chips)
  r["sharding"] = {"ici": {"data": 1, "fsdp": chips // tensor, "tensor": tensor}, "dcn": None}
  r["training"].update(per_device_batch=per_device, global_batch_seqs=int(per_device * chips))
  if "cudnn" in str(r["training"].get("attention_kernel", "")).lower():   # a GPU row: XLA attention on the TPU
    r["training"]["attention_kernel"] = "plain XLA dot-product attention (retargeted from a GPU row)"
  return r


def split(pr) -> dict:
  """Seconds per step: compute, HBM, ICI, DCN (priced), exposed collectives, the step."""
  b, c = pr.breakdown, pr.breakdown["collectives"]
  links = c["by_link"]
  return {"step": pr.step_seconds, "compute": b["compute_seconds"], "hbm": b["memory_seconds"],
          "ici": sum(v for k, v in links.items() if k != "dcn"), "dcn": links.get("dcn", 0.0),
          "exposed": c["exposed_seconds"], "mxu": b.get("mxu_utilization", 1.0), "mfu": pr.mfu}


def line(rid: str, chip: str, chips: int, s: dict, entry: dict) -> str:
  from shardax.perf import program
  prog = entry.get("program")
  return (f"| {rid} | {chip} | {chips} | {s['step']:.2f} s | {s['compute']:.2f} | {s['hbm']:.2f} | "
          f"{s['ici']:.2f} | {s['dcn']:.2f} | {s['exposed']:.2f} | {s['mxu']:.2f} | {s['mfu']:.0%} | "
          f"{program.format_summary(prog) if prog else '-'} |")


HEADER = ("| row | chip | chips | predicted step | compute s | HBM s | ICI s | DCN s | exposed s | "
          "MXU use | MFU | compiled program |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def entry_for(row: dict, cache: str, compile_missing: bool, layers: int, reread: str = "") -> dict | None:
  """The cached entry of `row` (re-derived from its kept program under `reread`, a
  CALIBRATE_HLO_DIR); else, with `compile_missing`, a fresh compile."""
  import gzip
  path = os.path.join(cache, f"{row['id']}.json")
  kept = os.path.join(reread, f"{row['id']}.txt.gz") if reread else ""
  if kept and os.path.exists(kept):
    with gzip.open(kept, "rt") as f:
      return calibrate.cache_entry(row, layers, f.read(), cache=cache)
  if os.path.exists(path):
    return json.load(open(path))
  return calibrate.compile_row(row, layers, cache) if compile_missing else None


def fitting(row: dict, gen: str, cache: str, layers: int, reread: str, compile_missing: bool):
  """The retargeted row and its entry (None: not compiled), the per-device batch halved until the
  shallow copy fits the target chip's HBM (the compiler refuses a program that does not:
  RESOURCE_EXHAUSTED) or, without `compile_missing`, until a cached compile is found."""
  batch = row["training"]["per_device_batch"]
  while batch >= 1:
    r = retarget(row, gen, per_device=batch)
    try:
      if entry := entry_for(r, cache, compile_missing, layers, reread):
        return r, entry
    except Exception as e:   # jax's JaxRuntimeError: the compile ran out of HBM
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      print(f"{r['id']}: does not fit {gen}'s HBM at per-device batch {batch}; halving", file=sys.stderr)
    batch //= 2
  return retarget(row, gen), None


def chip_table() -> str:
  """The TPU rows of the chip table with each figure's source (docs/results/chips_v5e_v6e.md)."""
  from shardax.perf import hardware
  fields = ("peak_bf16_flops", "peak_int8_flops", "hbm_bytes", "hbm_bandwidth", "cores_per_chip", "mxus_per_core",
            "mxu_dim", "clock_hz", "ici_links_per_chip", "ici_link_bandwidth", "dcn_bandwidth", "matmul_efficiency")
  tpus = [c for c in hardware.CHIPS.values() if c.torus_dims]
  lines = ["| field | " + " | ".join(c.name for c in tpus) + " |", "|---|" + "---|" * len(tpus)]
  for f in fields:
    lines.append(f"| {f} | " + " | ".join(f"{getattr(c, f):.4g}" for c in tpus) + " |")
  sources = sorted({src for c in tpus for src in c.sources.values()})
  lines += ["", "Sources (per field and row: `hardware.CHIPS[name].sources`):"] + [f"* {s}" for s in sources]
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default="/work/shared/published-runs/calibration.json")
  p.add_argument("--rows", default="")
  p.add_argument("--on", default="", help="comma-separated generations to retarget the rows to (v5e, v6e)")
  p.add_argument("--compile", action="store_true", help="compile retargeted rows whose cache is missing")
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--reread", default="", help="a CALIBRATE_HLO_DIR: re-derive retargeted entries from the kept programs")
  p.add_argument("--chips", action="store_true", help="print the TPU chip table with its sources and stop")
  a = p.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if a.chips:
    print(chip_table())
    return
  rows = json.load(open(a.runs))
  if a.rows:
    rows = [r for r in rows if r["id"] in a.rows.split(",")]
  print(HEADER)
  for row in rows:
    targets = [(row, calibrate.CACHE, None)] + [(row, RETARGETED, g) for g in a.on.split(",") if g]
    for r, cache, gen in targets:
      if gen:
        r, entry = fitting(r, gen, cache, a.layers, a.reread, a.compile)
      else:
        entry = entry_for(r, cache, False, a.layers)
      if entry is None:
        print(f"| {r['id']} | | | not compiled (--compile) | | | | | | | | |")
        continue
      pr = calibrate.predict_row(r, entry)
      print(line(r["id"], pr.chip, r["hardware"]["total_chips"], split(pr), entry), flush=True)


if __name__ == "__main__":
  main()
