"""The dry-run figures of every registered pod experiment, and which of them moved between two trees.

  python benchmarks/dry_run_figures.py run --out AFTER.json [--compile_effort=-1] [--shallow]
      [--exp NAME ...] [--max_devices N] [--job_root DIR]
  python benchmarks/dry_run_figures.py compare BEFORE.json AFTER.json [--rtol 1e-9]

`run` dry-runs (`python -m shardax.main --mode=dry_run`) every registered experiment that
names a TPU topology (`mesh.topology`), smallest pod first, one at a time under `nice`, each
in its own process, reads the `dry_run.json` it leaves in its job dir and writes one record
per experiment: the predicted step and what it is made of, MFU, per-chip memory (peak,
argument, output, alias, temp), FLOPs and bytes accessed, and the collectives' count and
bytes by kind (and by network on a multi-slice mesh). The file is rewritten after each
experiment, so an interrupted run keeps what it has, and a second run with the same `--out`
skips the experiments already in it.

The tree under test is whatever `import shardax` finds in the interpreter this script
starts (`--python`, default this one) with this process's PYTHONPATH, so an older commit
is measured from a worktree: `git worktree add /tmp/before COMMIT`, a directory holding
a `shardax` symlink to it, and `PYTHONPATH=that_directory`. The record names the package
directory it imported and its git commit; the experiment list is read from that tree too.

`compare` prints a markdown table of every figure that differs by more than `--rtol`
(relative), with both values and the relative change, plus the figures and experiments
present on one side only. Timings (compile and dry-run seconds) are kept in the records
but never compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

# Listed from the tree under test: registered names whose built config names a TPU topology,
# with the number of chips (topology dims x DCN granules) to order them by pod size.
_LIST = r"""
import json, math, shardax
from shardax.configs import registry
rows = []
for name in registry.names():
  exp = registry.build(registry.get(name))
  topo = exp.mesh.topology
  if topo:
    dims = [int(d) for d in topo.split(":")[1].split("x")]
    rows.append({"name": name, "topology": topo, "dcn": list(exp.mesh.dcn or ()),
                 "chips": math.prod(dims) * math.prod(exp.mesh.dcn or (1,))})
print(json.dumps({"package": shardax.__path__[0], "experiments": rows}))
"""

# Never compared: they measure this machine, not the program or its pricing.
TIMINGS = ("compile_seconds", "compile_cpu_seconds", "dry_run_seconds")


def _number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def figures(report: dict) -> dict[str, float | bool | str | None]:
  """The comparable figures of one dry_run.json (the same keys before and after the house
  move: the report's format did not change), flattened to `group.name` keys."""
  out: dict = {"fits": report.get("fits"), "error": report.get("error"),
               "num_devices": report.get("num_devices"), "num_params": report.get("num_params"),
               "hbm_bytes_per_device": report.get("hbm_bytes_per_device"),
               "compile_path": report.get("compile_path")}
  for k, v in (report.get("bytes_per_device") or {}).items():
    out[f"memory.{k}"] = v
  for k in ("flops_per_device", "flops_loop_bodies_once", "bytes_accessed_per_device",
            "model_flops_per_step"):
    out[k] = report.get(k)
  for kind, c in sorted((report.get("collectives") or {}).items()):
    out[f"collectives.{kind}.count"] = c.get("count")
    out[f"collectives.{kind}.bytes"] = c.get("bytes")
  for net, rows in sorted((report.get("networks") or {}).items()):
    for kind, c in sorted(rows.items()):
      out[f"network.{net}.{kind}.count"] = c.get("count")
      out[f"network.{net}.{kind}.bytes"] = c.get("bytes")
  refused = report.get("prediction_refused")
  if refused:
    out["refused.step_seconds"] = refused.get("step_seconds")
  p = report.get("predicted")
  if p:
    b = p.get("breakdown") or {}
    c = b.get("collectives") or {}
    out.update({"predicted.step_seconds": p.get("step_seconds"), "predicted.mfu": p.get("mfu"),
                "predicted.hfu": p.get("hfu"),
                "predicted.compute_seconds": b.get("compute_seconds"),
                "predicted.memory_seconds": b.get("memory_seconds"),
                "predicted.collectives_exposed_seconds": c.get("exposed_seconds"),
                "predicted.collectives_hidden_seconds": c.get("hidden_seconds"),
                "predicted.bubble_seconds": b.get("bubble_seconds"),
                "predicted.recompute_factor": b.get("recompute_factor"),
                "predicted.mxu_utilization": b.get("mxu_utilization"),
                "predicted.flash_kernel_seconds": b.get("flash_kernel_seconds")})
    for group in ("by_kind", "by_axis", "by_link"):
      for k, v in sorted((c.get(group) or {}).items()):
        out[f"predicted.collective_seconds.{group}.{k}"] = v
  return {k: v for k, v in out.items() if v is not None or k in ("fits", "error")}


def _tree(python: str, env: dict, cwd: str) -> dict:
  """The package the interpreter imports as `shardax`, its git commit, and its pod experiments."""
  r = subprocess.run([python, "-c", _LIST], env=env, cwd=cwd, capture_output=True, text=True)
  if r.returncode:
    sys.exit(f"listing the experiments failed:\n{r.stderr[-3000:]}")
  tree = json.loads(r.stdout.strip().splitlines()[-1])
  git = subprocess.run(["git", "-C", os.path.realpath(tree["package"]), "rev-parse", "HEAD"],
                       capture_output=True, text=True)
  tree["commit"] = git.stdout.strip() or None
  return tree


def _dry_run(python: str, env: dict, cwd: str, name: str, job_dir: str, args) -> dict:
  """One experiment's dry run in its own process; its record (figures, or the failure)."""
  cmd = ["nice", "-n", str(args.nice), python, "-m", "shardax.main", f"--exp={name}",
         f"--job_dir={job_dir}", "--mode=dry_run"]
  if args.compile_effort is not None:
    cmd.append(f"--compile_effort={args.compile_effort}")
  if args.shallow:
    cmd.append("--shallow")
  start = time.perf_counter()
  os.makedirs(job_dir, exist_ok=True)
  log = os.path.join(job_dir, "dry_run_figures.out.txt")  # the whole output, for a crash
  with open(log, "w") as f:
    try:
      rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT,
                          timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
  wall = time.perf_counter() - start
  record = {"command": " ".join(cmd[3:]), "returncode": rc, "wall_seconds": round(wall, 1), "output": log}
  path = os.path.join(job_dir, "dry_run.json")
  if not os.path.exists(path):  # a crash (a "does not fit" exit 1 still writes its report)
    return {**record, "failed": _first_error(log, rc)}
  with open(path) as f:
    report = json.load(f)
  return {**record, "figures": figures(report),
          "timings": {k: report.get(k) for k in TIMINGS if report.get(k) is not None}}


def _first_error(log: str, rc) -> str:
  """The line that says why a dry run died (a fatal check, an abort, a Python error)."""
  with open(log, errors="replace") as f:
    lines = f.read().splitlines()
  marks = ("Check failed", "Fatal Python error", "F0", "F1", "Error:", "error:", "Traceback")
  found = [l for l in lines if any(l.startswith(m) or m in l[:40] for m in marks)]
  return f"exit {rc}: " + " | ".join((found or lines[-1:])[:3])[:600]


def run(args) -> None:
  python = args.python or sys.executable
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cwd = tempfile.mkdtemp(prefix="dry_run_figures-")  # no `shardax/` folder beside the process
  tree = _tree(python, env, cwd)
  exps = sorted(tree["experiments"], key=lambda e: (e["chips"], e["name"]))
  if args.exp:
    unknown = set(args.exp) - {e["name"] for e in exps}
    if unknown:
      sys.exit(f"--exp {sorted(unknown)}: not a registered experiment with mesh.topology in "
               f"{tree['package']}; those are: {', '.join(e['name'] for e in exps)}")
    exps = [e for e in exps if e["name"] in args.exp]
  if args.max_devices:
    exps = [e for e in exps if e["chips"] <= args.max_devices]
  out = {"records": {}}
  if os.path.exists(args.out):
    with open(args.out) as f:
      out = json.load(f)
  out.update(package=tree["package"], commit=tree["commit"], python=python,
             compile_effort=args.compile_effort, shallow=args.shallow, host=os.uname().nodename,
             experiments=[e["name"] for e in exps])
  print(f"tree {tree['package']} at {tree['commit']}: {len(exps)} pod experiments", flush=True)
  for e in exps:
    if e["name"] in out["records"] and "figures" in out["records"][e["name"]]:
      print(f"  {e['name']}: already in {args.out}", flush=True)
      continue
    job_dir = os.path.join(args.job_root, e["name"])
    if os.path.exists(os.path.join(job_dir, "dry_run.json")):
      os.remove(os.path.join(job_dir, "dry_run.json"))  # never read a previous run's report
    load = os.getloadavg()[0]
    rec = _dry_run(python, env, cwd, e["name"], job_dir, args)
    rec.update(topology=e["topology"], dcn=e["dcn"], chips=e["chips"], load_before=round(load, 2),
               finished=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    out["records"][e["name"]] = rec
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1, sort_keys=True)
    print(f"  {e['name']} ({e['topology']}, {e['chips']} chips): {rec['wall_seconds']:.0f} s, "
          f"{_summary(rec)}", flush=True)


def _summary(rec: dict) -> str:
  """One line of a record: its step and peak, or why it has none."""
  if "figures" not in rec:
    return "FAILED: " + rec["failed"][-300:]
  f = rec["figures"]
  peak = f.get("memory.total")
  peak = f"{peak / 2**30:.2f} GiB" if peak else "?"
  if step := f.get("predicted.step_seconds"):
    return f"step {step:.4g} s, peak {peak}"
  return f"no prediction (fits {f.get('fits')}, peak {peak}, {f.get('error') or 'no chip row or refused'})"


def _rel(a, b) -> float | None:
  if not (_number(a) and _number(b)):
    return None
  if a == b:
    return 0.0
  return math.inf if a == 0 else (b - a) / abs(a)


def _fmt(v) -> str:
  if _number(v):
    return f"{v:,}" if isinstance(v, int) else f"{v:.6g}"
  return "-" if v is None else str(v)


def changes(before: dict, after: dict, rtol: float) -> list[tuple[str, str, object, object, float | None]]:
  """(experiment, figure, before, after, relative change) for every figure that moved by more
  than `rtol`, appeared or went, and every experiment on one side only (figure '(experiment)')."""
  rows = []
  b_recs, a_recs = before["records"], after["records"]
  for name in sorted(set(b_recs) | set(a_recs)):
    if name not in b_recs or name not in a_recs:
      rows.append((name, "(experiment)", "present" if name in b_recs else None,
                   "present" if name in a_recs else None, None))
      continue
    fb, fa = b_recs[name].get("figures"), a_recs[name].get("figures")
    if fb is None or fa is None:
      rows.append((name, "(dry run)", "ok" if fb else "failed", "ok" if fa else "failed", None))
      continue
    for key in sorted(set(fb) | set(fa)):
      vb, va = fb.get(key), fa.get(key)
      rel = _rel(vb, va)
      if rel is None:
        if vb != va:
          rows.append((name, key, vb, va, None))
      elif abs(rel) > rtol:
        rows.append((name, key, vb, va, rel))
  return rows


def _cell(rec: dict | None, key: str, unit: str) -> str:
  if rec is None:
    return "not run"
  f = rec.get("figures")
  if f is None:
    return "failed"
  v = f.get(key)
  if v is None:
    return "does not fit" if f.get("fits") is False else "-"
  over = " (over HBM)" if unit == "GiB" and f.get("fits") is False else ""
  return {"s": f"{v:.4g} s", "%": f"{100 * v:.1f}%", "GiB": f"{v / 2**30:.2f} GiB{over}"}[unit]


def summary(before: dict, after: dict) -> str:
  """One row per experiment: predicted step, MFU and per-chip peak, before and after."""
  rows = ["| experiment | topology | step before | step after | MFU before | MFU after | "
          "peak before | peak after |", "|---|---|---|---|---|---|---|---|"]
  recs = {**before["records"], **after["records"]}
  for name in sorted(recs, key=lambda n: (recs[n].get("chips", 0), n)):
    b, a = before["records"].get(name), after["records"].get(name)
    topo = recs[name].get("topology", "")
    if recs[name].get("dcn"):
      topo = f"{math.prod(recs[name]['dcn'])} x {topo}"
    cells = [_cell(r, k, u) for k, u in (("predicted.step_seconds", "s"), ("predicted.mfu", "%"),
                                         ("memory.total", "GiB")) for r in (b, a)]
    rows.append(f"| {name} | {topo} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def compare(args) -> None:
  with open(args.before) as f:
    before = json.load(f)
  with open(args.after) as f:
    after = json.load(f)
  rows = changes(before, after, args.rtol)
  same = sorted(n for n in set(before["records"]) & set(after["records"])
                if not any(r[0] == n for r in rows))
  print(f"before: {before.get('commit')} ({before.get('package')}); after: {after.get('commit')} "
        f"({after.get('package')}); compile effort {before.get('compile_effort')} / "
        f"{after.get('compile_effort')}, shallow {before.get('shallow')} / {after.get('shallow')}\n")
  print(summary(before, after) + "\n\nFigures that moved:\n")
  print("| experiment | figure | before | after | change |\n|---|---|---|---|---|")
  for name, key, vb, va, rel in rows:
    change = "" if rel is None else ("new" if math.isinf(rel) else f"{100 * rel:+.3g}%")
    print(f"| {name} | {key} | {_fmt(vb)} | {_fmt(va)} | {change} |")
  print(f"\nunchanged (every figure within rtol {args.rtol:g}): {', '.join(same) or 'none'}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  r = sub.add_parser("run", help="dry-run every pod experiment of the tree `import shardax` finds")
  r.add_argument("--out", required=True, help="the records' JSON (extended if it exists)")
  r.add_argument("--job_root", default=os.path.join(tempfile.gettempdir(), "dry_run_figures"),
                 help="each experiment's job dir is JOB_ROOT/NAME")
  r.add_argument("--exp", action="append", help="only these experiments (repeatable)")
  r.add_argument("--max_devices", type=int, help="only pods of at most this many chips")
  r.add_argument("--compile_effort", type=float, help="passed to the dry run (-1: fastest compile)")
  r.add_argument("--shallow", action="store_true", help="extrapolate from shallow copies")
  r.add_argument("--python", help="the interpreter that runs the dry runs (default: this one)")
  r.add_argument("--nice", type=int, default=10)
  r.add_argument("--timeout", type=float, default=1800, help="seconds per dry run")
  c = sub.add_parser("compare", help="every figure that moved between two `run` outputs")
  c.add_argument("before")
  c.add_argument("after")
  c.add_argument("--rtol", type=float, default=1e-9, help="relative change below which a figure is the same")
  args = ap.parse_args()
  run(args) if args.cmd == "run" else compare(args)


if __name__ == "__main__":
  main()
