"""How far to trust a predicted step: the spread of the step model's errors on published runs
of the chip's family, as an interval for a run it has not seen.

Nothing in the step model is set from the calibration rows: its figures are datasheet
figures (hardware.py) and efficiencies measured apart from them (ops.py: 0.8 on TPU,
set before the TPU rows were compared; the H100's from a profile of lm.1b), and the
programs are the compiler's. So a row's error is already out of sample: leaving the row
out changes no term of the model, and the leave-one-out error of each row equals its
in-sample error. What leave-one-out does test is the bar itself: each row's error is
checked against the interval the *other* rows of its family give (`leave_one_out`), so
a row never vouches for itself and the file records how often the bar held.

The bar is a small-sample prediction interval for one new run's predicted / published
ratio r (Student's t on log r, n - 1 degrees of freedom; `interval`):

    exp(mean(log r) +- t(COVERAGE, n - 1) x stdev(log r) x sqrt(1 + 1/n))

It assumes a family's rows are exchangeable draws; they are not independent (the same
model at several slice counts), so the interval is if anything narrow. A family with
fewer than 2 rows has no interval. A chip without calibrated rows borrows the figures of
the calibrated chip of the same kind (TPU or GPU) whose balance of compute to memory
(peak bf16 FLOP/s over HBM bytes/s) is nearest, and says so.

benchmarks/calibrate.py writes `ERRORS` (perf/calibration_errors.json, package data: an
installed wheel carries it) with `write` whenever it prices the whole table: each row's
chip, ratio and leave-one-out check, and each family's summary, which `for_chip` reads.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from shardax.perf import hardware

ERRORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration_errors.json")
COVERAGE = 0.9   # two-sided: the interval should hold a new run's ratio 9 times in 10
_SHORT = {"TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e", "TPU v4": "v4", "TPU v3": "v3"}


def short(chip: hardware.Chip) -> str:
  return _SHORT.get(chip.name, chip.name)


def factor(ratio: float) -> float:
  """The error factor max(pred/pub, pub/pred) of a predicted / published ratio."""
  return max(ratio, 1 / ratio)


def interval(ratios: list[float], coverage: float = COVERAGE) -> tuple[float, float] | None:
  """The `coverage` prediction interval (lo, hi) of one more ratio from the same family as
  `ratios` (module docstring); None with fewer than 2 ratios."""
  if len(ratios) < 2:
    return None
  from scipy import stats   # only when writing the summary: a dry run reads the file
  logs = [math.log(r) for r in ratios]
  n, mean = len(logs), statistics.fmean(logs)
  half = float(stats.t.ppf(0.5 + coverage / 2, n - 1)) * statistics.stdev(logs) * math.sqrt(1 + 1 / n)
  return math.exp(mean - half), math.exp(mean + half)


def leave_one_out(rows: dict[str, tuple[str, float]]) -> dict[str, dict]:
  """{row id: {'chip', 'ratio', 'loo': the interval of the OTHER rows of its chip (or None),
  'inside': whether the row's ratio lies in it (None without one)}}; `rows`: {row id: (chip
  name, predicted / published)}."""
  out = {}
  for rid, (chip, r) in sorted(rows.items()):
    others = [o for oid, (c, o) in rows.items() if c == chip and oid != rid]
    bar = interval(others)
    out[rid] = {"chip": chip, "ratio": r, "loo": list(bar) if bar else None,
                "inside": None if bar is None else bool(bar[0] <= r <= bar[1])}
  return out


def summary(rows: dict[str, tuple[str, float]]) -> dict:
  """What `write` stores: the rows with their leave-one-out checks and, per chip, the rows'
  count, median and worst error factor, the interval from all its rows, and how many rows
  lay inside the interval of the others ('loo_inside' of 'loo_checked'); 'fit_on_rows'
  names the step model's figures set from these rows: none (module docstring)."""
  checked = leave_one_out(rows)
  fams: dict[str, list[str]] = {}
  for rid, r in checked.items():
    fams.setdefault(r["chip"], []).append(rid)
  families = {}
  for chip, ids in sorted(fams.items()):
    ratios = [checked[i]["ratio"] for i in ids]
    bar = interval(ratios)
    verdicts = [checked[i]["inside"] for i in ids if checked[i]["inside"] is not None]
    families[chip] = {"rows": len(ids), "median": statistics.median(factor(r) for r in ratios),
                      "worst": max(factor(r) for r in ratios), "interval": list(bar) if bar else None,
                      "loo_inside": sum(verdicts), "loo_checked": len(verdicts)}
  return {"coverage": COVERAGE, "fit_on_rows": [], "rows": checked, "families": families}


def families(path: str | None = None) -> dict[str, dict]:
  """Chip name -> its family summary (`summary`), {} without a summary file."""
  path = path or ERRORS
  if not os.path.exists(path):
    return {}
  data = json.load(open(path))
  if "families" not in data:   # rows alone: summarize them here
    data = summary({rid: (r["chip"], r["ratio"]) for rid, r in data["rows"].items()})
  return data["families"]


def _balance(chip: hardware.Chip) -> float:
  return chip.peak_bf16_flops / chip.hbm_bandwidth


def _figures(f: dict) -> str:
  bar = f.get("interval")
  text = f"error median {f['median']:.2f}x, worst {f['worst']:.2f}x"
  if bar:
    text += (f"; {COVERAGE:.0%} interval for a new run's pred/pub {bar[0]:.2f}x-{bar[1]:.2f}x (each row "
             f"inside the others' interval: {f['loo_inside']} of {f['loo_checked']})")
  return text


def for_chip(chip: hardware.Chip, path: str | None = None) -> dict:
  """{'family', 'rows', 'median', 'worst', 'interval', 'nearest', 'line'} for `chip`."""
  fams = families(path)
  if not fams:
    return {"family": chip.name, "rows": 0, "line": "  calibration: no summary (run benchmarks/calibrate.py)"}
  if chip.name in fams:
    f = fams[chip.name]
    return {"family": chip.name, "rows": f["rows"], "median": f["median"], "worst": f["worst"],
            "interval": f["interval"], "nearest": chip.name,
            "line": f"  calibration ({short(chip)}, {f['rows']} published runs): {_figures(f)}"}
  same_kind = [n for n in fams if (hardware.CHIPS[n].torus_dims > 0) == (chip.torus_dims > 0)] or list(fams)
  near = min(same_kind, key=lambda n: abs(math.log(_balance(hardware.CHIPS[n]) / _balance(chip))))
  f = fams[near]
  return {"family": chip.name, "rows": 0, "median": f["median"], "worst": f["worst"], "interval": f["interval"],
          "nearest": near,
          "line": f"  calibration: {short(chip)}: no calibrated runs; expect larger error (nearest calibrated "
                  f"family by FLOP/byte, {short(hardware.CHIPS[near])}: {f['rows']} runs, {_figures(f)})"}


def write(rows: dict[str, tuple[str, float]], path: str | None = None) -> None:
  """Store `summary` of {row id: (chip name, predicted / published)} for `for_chip`
  (benchmarks/calibrate.py, over the whole table)."""
  with open(path or ERRORS, "w") as f:
    json.dump(summary(rows), f, indent=1)
    f.write("\n")
