"""The plan for a pod experiment (default pod.lm_1t on v3:32x32): docs/scale.md's "Plan" section.

  python benchmarks/plan_pod.py --exp pod.lm_1t --job_dir /tmp/plan_1t

runs `--mode=plan` with the default candidate grid (perf/plan.py), writes
plan.json into the job dir, and prints the ranking as a markdown table, with the wall
and CPU seconds and the host's load average before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def markdown(p: dict, top: int) -> str:
  rows = ["| rank | predicted step | per-device memory | `--set` line |", "|---|---|---|---|"]
  for i, idx in enumerate(p["ranked"][:top]):
    r = p["candidates"][idx]
    rows.append(f"| {i + 1} | {r['predicted_step_seconds']:.2f} s | "
                f"{r['bytes_per_device'] / 2**30:.2f} GiB | `{r['set_line']}` |")
  dropped = ["", "| dropped | reason |", "|---|---|"]
  for r in p["candidates"]:
    if r["status"] != "ok":
      dropped.append(f"| `{r['set_line']}` | {r['status']}: {r['reason']} |")
  return "\n".join(rows + dropped)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--exp", default="pod.lm_1t")
  ap.add_argument("--job_dir", default="/tmp/plan_pod")
  ap.add_argument("--top", type=int, default=10)
  ap.add_argument("--shallow", action="store_true", help="extrapolate from shallow copies")
  args = ap.parse_args()
  from shardax.perf import plan
  load0, cpu0, t0 = os.getloadavg(), time.process_time(), time.perf_counter()
  base = plan.Base(args.exp)
  p = plan.plan(base.build(), base, args.job_dir, shallow=args.shallow,
                log=lambda s: print(s, flush=True))
  wall, cpu, load1 = time.perf_counter() - t0, time.process_time() - cpu0, os.getloadavg()
  print(plan.format_plan(p, top=args.top))
  print(f"\nwall {wall:.0f} s, CPU {cpu:.0f} s (all threads), load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
  print(markdown(p, args.top))


if __name__ == "__main__":
  main()
