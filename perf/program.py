"""What the compiler made of a step, in counts a reader can compare across chip families.

`summary(hlo_text)`: fusions by kind (kLoop elementwise, kInput reductions, kOutput
matmul/convolution fusions, kCustom), the dots and dot-like convolutions left, and the
collectives by kind: how many, how many are asynchronous (`-start`/`-done` pairs the
latency-hiding scheduler can overlap with compute: perf/stepmodel.py assumption 4)
and their bytes per step (loop trip counts applied). The step model's inputs (FLOPs, bytes
accessed) are in perf/costs.py; this is the structure beside them, read once per
compile and cached with the calibration rows (benchmarks/calibrate.py).
"""

from __future__ import annotations

import collections

from shardax.perf import hlo
from shardax.perf.hlo import matmuls
from shardax.sharding import report


def summary(hlo_text: str, collectives=None) -> dict:
  """The counts of `hlo_text`; `collectives`: its `report.collectives`, when read already
  (costs.of_hlo_text holds them), else read here."""
  fusions, dots = collections.Counter(), 0
  for inst in hlo.parse(hlo_text):
    if inst.opcode == "fusion" and inst.attr("kind").startswith("k"):
      fusions[inst.attr("kind")] += 1
    elif inst.opcode in matmuls.OPCODES:
      dots += 1
  kinds: dict[str, dict] = {}
  for c in report.collectives(hlo_text) if collectives is None else collectives:
    k = kinds.setdefault(c.kind + (" (DCN)" if c.link == "dcn" else ""), {"count": 0, "async": 0, "bytes": 0})
    k["count"] += 1
    k["async"] += int(c.is_async)
    k["bytes"] += c.bytes * c.executions
  return {"fusions": dict(fusions), "dots": dots, "collectives": kinds}


def format_summary(s: dict) -> str:
  """One line: 'fusions 412 (kLoop 300, kOutput 90, ...), dots 120; all-gather 12 (12 async, 3.1 GB), ...'."""
  f = s.get("fusions", {})
  fusions = f"fusions {sum(f.values())} ({', '.join(f'{k} {v}' for k, v in sorted(f.items()))})"
  colls = "; ".join(f"{k} {v['count']} ({v['async']} async, {v['bytes'] / 1e9:.3g} GB/step)"
                    for k, v in sorted(s.get("collectives", {}).items()))
  return f"{fusions}, dots {s.get('dots', 0)}; {colls or 'no collectives'}"
