"""How far to trust a predicted step: the calibration error of the chip's family, or of the
nearest family that has calibrated rows.

benchmarks/calibrate.py writes each row's error (predicted / published step) with the chip
it ran on to `ERRORS` (perf/calibration_errors.json, package data: an installed
wheel carries it, pyproject.toml) whenever it prices the whole table. Here those
rows are grouped by chip (the chip table's row name) and summarized as the median and worst
error factor max(pred/pub, pub/pred). A chip with no calibrated rows says so and borrows
the figures of the calibrated chip of the same kind (TPU or GPU) whose balance of compute
to memory (peak bf16 FLOP/s over HBM bytes/s, hardware.py) is nearest: the property that
decides whether the same layer is compute- or memory-bound on both.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from shardax.perf import hardware

ERRORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_errors.json")
_SHORT = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v4": "v4", "TPU v3": "v3"}


def short(chip: hardware.Chip) -> str:
  return _SHORT.get(chip.name, chip.name)


def families(path: str | None = None) -> dict[str, list[float]]:
  """Chip name -> the error factors of its calibrated rows ({} without a summary file)."""
  path = path or ERRORS
  if not os.path.exists(path):
    return {}
  out: dict[str, list[float]] = {}
  for r in json.load(open(path))["rows"].values():
    out.setdefault(r["chip"], []).append(max(r["ratio"], 1 / r["ratio"]))
  return out


def _balance(chip: hardware.Chip) -> float:
  return chip.peak_bf16_flops / chip.hbm_bandwidth


def for_chip(chip: hardware.Chip, path: str | None = None) -> dict:
  """{'family', 'rows', 'median', 'worst', 'nearest', 'line'} for `chip`."""
  fams = families(path)
  if not fams:
    return {"family": chip.name, "rows": 0, "line": "  calibration: no summary (run benchmarks/calibrate.py)"}
  if chip.name in fams:
    errs = fams[chip.name]
    return {"family": chip.name, "rows": len(errs), "median": statistics.median(errs), "worst": max(errs),
            "nearest": chip.name,
            "line": f"  calibration ({short(chip)}, {len(errs)} published runs): error median "
                    f"{statistics.median(errs):.2f}x, worst {max(errs):.2f}x"}
  same_kind = [n for n in fams if (hardware.CHIPS[n].torus_dims > 0) == (chip.torus_dims > 0)] or list(fams)
  near = min(same_kind, key=lambda n: abs(math.log(_balance(hardware.CHIPS[n]) / _balance(chip))))
  errs = fams[near]
  return {"family": chip.name, "rows": 0, "median": statistics.median(errs), "worst": max(errs), "nearest": near,
          "line": f"  calibration: {short(chip)}: no calibrated runs; expect larger error (nearest calibrated "
                  f"family by FLOP/byte, {short(hardware.CHIPS[near])}: {len(errs)} runs, error median "
                  f"{statistics.median(errs):.2f}x, worst {max(errs):.2f}x)"}


def write(rows: dict[str, tuple[str, float]], path: str | None = None) -> None:
  """Store {row id: (chip name, predicted / published)} for `for_chip` (benchmarks/calibrate.py)."""
  with open(path or ERRORS, "w") as f:
    json.dump({"rows": {rid: {"chip": c, "ratio": r} for rid, (c, r) in sorted(rows.items())}}, f, indent=1)
