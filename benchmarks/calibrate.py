"""Check the step-time model against published training runs; regenerate the table of
docs/results/calibration.md.

    PYTHONPATH=... python benchmarks/calibrate.py [--runs ../shared/published-runs/calibration.json]
        [--rows ID,ID,...] [--compile] [--layers 3] [--write-docs] [--reread HLO_DIR]

Each row of the published-runs table is rebuilt as a shardax experiment
(experiments/calibration.py) and its train step compiled for the row's TPU topology
with libtpu, nothing allocated. Compiling 35 pod-sized programs on a small machine is
expensive, so each row compiles a shallow copy (`--layers`, scanned) and the loop-aware
costs are deepened to the row's depth (perf/costs.py `deepen`: the layer loop
runs L/l times as often; what lies outside it scales with the parameter count). The
costs of each compile are cached in benchmarks/calibration/<row>.json, so the model
(perf/stepmodel.py) can be re-evaluated on every row in seconds; `--compile`
compiles the rows whose cache is missing, and recompiles those whose cache was compiled
with another attention kernel or remat policy than the row now maps to, or (multi-slice
rows) before the cross-slice transfers were read (without `--compile` such a row's
"approximates" or DCN column says so). Prints each row, its predicted / published
ratio, and the median and worst error factor max(pred/pub, pub/pred) overall and per
chip family.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RUNS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "published-runs", "calibration.json")
CACHE = os.path.join(HERE, "calibration")
DOCS = os.path.join(os.path.dirname(HERE), "docs", "results", "calibration.md")
BEGIN, END = "<!-- calibration:begin -->", "<!-- calibration:end -->"


def _build(row: dict, layers: int | None):
  from shardax import configs
  from shardax.experiments import calibration
  return configs.build(calibration.from_row(row, layers))


_LIBTPU_ARGS: list[str] = []   # LIBTPU_INIT_ARGS as this process's libtpu read it (at the first compile)


def _apply_libtpu_flags(row: dict) -> tuple[str, ...]:
  """Sets the row's libtpu flags (`calibration.libtpu_flags`: the published run's LIBTPU_INIT_ARGS,
  one flag an entry, and a GPU row's stand-in flags) before libtpu loads; libtpu reads them once
  a process, so a row whose flags differ from those the process already compiled with is refused
  (compile it alone: --rows ID)."""
  from shardax.experiments import calibration
  from shardax.sharding import libtpu_flags
  flags = calibration.libtpu_flags(row)
  args = libtpu_flags.apply(flags)
  if _LIBTPU_ARGS and _LIBTPU_ARGS[0] != args:
    raise ValueError(f"row {row['id']}: training.libtpu_flags differ from those libtpu was loaded with in this "
                     f"process ({_LIBTPU_ARGS[0]!r}); compile the row in its own process (--rows {row['id']})")
  _LIBTPU_ARGS[:] = [args]
  return flags


def compile_row(row: dict, layers: int, cache: str | None = None) -> dict:
  """Compile the shallow copy of `row` (with its `training.libtpu_flags`, if any) and cache its
  loop-aware costs (in `cache`, else CACHE)."""
  from shardax.perf import dry_run
  flags = _apply_libtpu_flags(row)
  exp = _build(row, layers)
  mesh, setup = dry_run.prepare(exp)
  start, cpu = time.perf_counter(), time.process_time()
  hlo = dry_run.compile_step(setup).as_text()
  seconds = time.perf_counter() - start, time.process_time() - cpu
  if hlo_dir := os.environ.get("CALIBRATE_HLO_DIR"):   # keep the program to inspect or re-read (large)
    import gzip
    os.makedirs(hlo_dir, exist_ok=True)
    with gzip.open(os.path.join(hlo_dir, f"{row['id']}.txt.gz"), "wt") as f:
      f.write(hlo)
  return cache_entry(row, layers, hlo, seconds, cache, flags)


def cache_entry(row: dict, layers: int, hlo: str, seconds: tuple[float, float] = (0.0, 0.0),
                cache: str | None = None, flags: tuple[str, ...] = ()) -> dict:
  """What the step model needs of a compiled shallow copy (its loop-aware costs, the MXU read of
  its dots, the program summary), written to <cache, else CACHE>/<row id>.json: from a fresh
  compile, or from a program kept by CALIBRATE_HLO_DIR when how programs are read changes."""
  from shardax.perf import costs, mxu, program
  exp = _build(row, layers)
  cost = costs.of_hlo_text(hlo)
  entry = {"id": row["id"], "layers": layers, "topology": exp.mesh.topology,
           "compile_seconds": seconds[0], "compile_cpu_seconds": seconds[1],
           "num_params_shallow": _params(exp), "attention": exp.model.attention, "remat": exp.model.remat,
           "libtpu_flags": list(flags),
           "costs": costs.to_json(cost), "mxu": mxu.by_piece(hlo, cost.owner),
           "program": program.summary(hlo, cost.collectives)}
  cache = cache or CACHE
  os.makedirs(cache, exist_ok=True)
  with open(os.path.join(cache, f"{row['id']}.json"), "w") as f:
    json.dump(entry, f)
  return entry


def _params(exp) -> int:
  """The parameter count that scales the per-parameter traffic when a compile is deepened:
  an MoE model's is dominated by its experts, which `matmul_params` (dense) does not hold."""
  from shardax.perf import flops
  m = exp.model
  if m.moe is not None:
    return m.param_count()
  return flops.matmul_params(m) + m.vocab_size * m.d_model * m.tied_embedding


def predict_row(row: dict, entry: dict):
  """The model's prediction for the full-depth row from its cached shallow costs; raises
  stepmodel.ImpossiblePrediction when the step model's figure is under the roofline."""
  from shardax.experiments import calibration
  from shardax.sharding import make_mesh
  from shardax.perf import hardware, costs, stepmodel
  exp = _build(row, None)
  shallow = costs.from_json(entry["costs"])
  scale = _params(exp) / entry["num_params_shallow"]
  deep = costs.deepen(shallow, entry["layers"], exp.model.num_layers, scale)
  mesh = make_mesh(exp.mesh)
  kind = calibration.gpu_kind(row) if calibration.is_gpu(row) else mesh.devices.flat[0].device_kind
  chip = hardware.lookup(kind, exp.mesh.network)
  # a Pallas flash call is 0 FLOPs in XLA's costs: from_costs adds the kernel's time
  return stepmodel.from_costs(deep, mesh, exp, chip, entry.get("mxu"), flash_kernel=entry.get("attention") == "flash")


def refused(e) -> str:
  """A row's table cell when the step model refuses its figure (stepmodel.ImpossiblePrediction)."""
  r = e.roofline
  return (f"refused: {e.prediction.step_seconds:.2f} s is under the roofline {r['seconds']:.2f} s (model FLOPs "
          f"at peak {r['model_flops_seconds']:.2f} s, HBM floor {r['hbm_floor_seconds']:.2f} s)")


def _published(row: dict) -> float:
  from shardax.experiments import calibration
  return calibration.published_step_seconds(row)


def ratio(predicted: float, published: float) -> str:
  """The error as a ratio a reader can take at face value: 1.61x over, 0.87x under."""
  return f"{predicted / published:.2f}x"


def dcn_unread(row: dict, entry: dict) -> bool:
  """A multi-slice row whose cache predates reading megascale transfers: its DCN is not priced."""
  from shardax.experiments import calibration
  slices = calibration.topology(row)[1]
  return slices > 1 and not any("link" in c for c in entry["costs"]["collectives"])


def compiled_as(row: dict, entry: dict) -> list[str]:
  """Notes for a cache compiled under an older mapping of the row's settings or read by an
  older reader: caches from before the kernel/remat mapping (no 'attention' key) were
  compiled with XLA attention and the remat then mapped (the same as now for every published
  row: none offloads); caches from before perf/hbm.py price on-chip traffic at the HBM rate;
  before `Piece.stacked`, the entry's head and loss traffic grew with depth; before
  `Piece.matmul_free_bytes`, a GPU row hid its elementwise kernels under its matmuls; a cache
  compiled with other libtpu flags than `calibration.libtpu_flags` gives the row now (a GPU
  row's stand-in before GPU_STAND_IN_LIBTPU_FLAGS: windowed einsums a GPU does not run). A noted
  cache is recompiled by `--compile` (or re-read with `--reread` from a kept program)."""
  from shardax.experiments import calibration
  exp = _build(row, None)
  notes = []
  was = entry.get("attention", "xla")
  if was != exp.model.attention:
    notes.append(f"cached compile: {was} attention, predates the {exp.model.attention} mapping")
  if entry.get("remat", exp.model.remat) != exp.model.remat:
    notes.append(f"cached compile: remat {entry['remat']}, predates the {exp.model.remat} mapping")
  pieces = entry.get("costs", {}).get("pieces", [])
  if pieces and "onchip_bytes" not in pieces[0] and not calibration.is_gpu(row):   # a stand-in keeps XLA's count
    notes.append("cached compile: on-chip buffers priced as HBM traffic, predates perf/hbm.py")
  if pieces and "stacked" not in pieces[0]:
    notes.append("cached compile: the entry's traffic deepened whole, predates its stacked share")
  if pieces and "matmul_free_bytes" not in pieces[0] and calibration.is_gpu(row):
    notes.append("cached compile: kernels without matmuls priced under the matmuls, predates perf/kernels.py")
  if pieces and tuple(entry.get("libtpu_flags", ())) != calibration.libtpu_flags(row):
    notes.append("cached compile: libtpu flags other than the row's (" + " ".join(calibration.libtpu_flags(row))
                 + "), predates them")
  return notes


def table(rows: list[dict], results: dict, unread: set = frozenset(),
          stale: dict | None = None) -> tuple[str, list[float]]:
  """The markdown table and each row's error factor max(pred/pub, pub/pred)."""
  from shardax.experiments import calibration
  lines = ["| row | chips | predicted step | published step | pred / pub | MFU pred / pub-derived | "
           "exposed comm | DCN | shardax approximates |", "|---|---|---|---|---|---|---|---|---|"]
  errors = []
  for row in rows:
    pr = results.get(row["id"])
    pub = calibration.published_step_seconds(row)
    if not hasattr(pr, "step_seconds"):
      lines.append(f"| {row['id']} | {row['hardware']['total_chips']} | {pr or 'not compiled'} | {pub:.2f} s "
                   f"| | | | | |")
      continue
    errors.append(max(pr.step_seconds / pub, pub / pr.step_seconds))
    pub_mfu = pr.mfu * pr.step_seconds / pub   # the published step under shardax's FLOP count
    exposed = pr.breakdown["collectives"]["exposed_seconds"] / pr.step_seconds
    dcn = pr.breakdown["collectives"]["by_link"].get("dcn", 0.0)
    lines.append(f"| {row['id']} | {row['hardware']['total_chips']} | {pr.step_seconds:.2f} s | {pub:.2f} s | "
                 f"{ratio(pr.step_seconds, pub)} | {pr.mfu:.0%} / {pub_mfu:.0%} | {exposed:.0%} | "
                 f"{'not read (old cache)' if row['id'] in unread else f'{dcn:.2f} s' if dcn else '-'} | "
                 f"{', '.join(calibration.approximations(row) + (stale or {}).get(row['id'], [])) or '-'} |")
  return "\n".join(lines), errors


def by_family(rows: list[dict], results: dict) -> list[str]:
  """Median and worst error factor per chip family."""
  from shardax.experiments import calibration
  families: dict[str, list[float]] = {}
  for row in rows:
    pr = results.get(row["id"])
    if hasattr(pr, "step_seconds"):
      pub = calibration.published_step_seconds(row)
      families.setdefault(row["hardware"]["accelerator"].split(" (")[0], []).append(
          max(pr.step_seconds / pub, pub / pr.step_seconds))
  return [f"{f}: {len(v)} rows, median {statistics.median(v):.2f}x, worst {max(v):.2f}x"
          for f, v in sorted(families.items())]


def evaluate(rows: list[dict], compile: bool = False, layers: int = 3,
             cache: str | None = None, hlo_dir: str = "") -> tuple[dict, set, dict]:
  """(row id -> Prediction, or the text of its cell when refused, not expressible or not compiled;
  the multi-slice rows whose cache did not read DCN; row id -> notes on a stale cache) for the
  cached rows of `rows`; `compile`: compile missing and stale caches first (`layers` deep);
  `hlo_dir`: re-read the cached rows whose program CALIBRATE_HLO_DIR kept there (how programs
  are read changed) before predicting, at the cached depth and flags."""
  from shardax.perf import stepmodel
  results, unread, stale = {}, set(), {}
  for row in rows:
    path = os.path.join(cache or CACHE, f"{row['id']}.json")
    try:
      _build(row, None)
    except ValueError as e:   # calibration.Unexpressible: the row says what is missing
      results[row["id"]] = f"not expressible: {e}".replace("|", "/")
      continue
    kept = os.path.join(hlo_dir, f"{row['id']}.txt.gz") if hlo_dir else ""
    if kept and os.path.exists(kept) and os.path.exists(path):   # re-read the kept program, no compile
      import gzip
      was = json.load(open(path))
      with gzip.open(kept, "rt") as f:
        cache_entry(row, was["layers"], f.read(), (was["compile_seconds"], was["compile_cpu_seconds"]),
                    cache, tuple(was.get("libtpu_flags", ())))
      print(f"re-read {row['id']} from {kept}", flush=True)
    if not os.path.exists(path):
      if not compile:
        continue
      entry = compile_row(row, layers, cache)
      print(f"compiled {row['id']} in {entry['compile_seconds']:.0f} s ({entry['compile_cpu_seconds']:.0f} s CPU)",
            flush=True)
    entry = json.load(open(path))
    if compile and (compiled_as(row, entry) or dcn_unread(row, entry)):   # stale cache: recompile
      entry = compile_row(row, layers, cache)
      print(f"recompiled {row['id']} in {entry['compile_seconds']:.0f} s", flush=True)
    if notes := compiled_as(row, entry):
      stale[row["id"]] = notes
    if dcn_unread(row, entry):
      unread.add(row["id"])
    try:
      results[row["id"]] = predict_row(row, entry)
    except stepmodel.ImpossiblePrediction as e:   # recorded, left out of the error bar
      results[row["id"]] = refused(e)
  return results, unread, stale


def errors_of(rows: list[dict], results: dict) -> dict[str, tuple[str, float]]:
  """{row id: (chip, predicted / published)} of the rows `evaluate` priced: what
  error_bar.write stores."""
  return {r["id"]: (results[r["id"]].chip, results[r["id"]].step_seconds / _published(r))
          for r in rows if hasattr(results.get(r["id"]), "step_seconds")}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--runs", default=RUNS, help="the published-runs table (default: ../shared beside the checkout)")
  p.add_argument("--rows", default="")
  p.add_argument("--compile", action="store_true")
  p.add_argument("--layers", type=int, default=3)
  p.add_argument("--write-docs", action="store_true")
  p.add_argument("--reread", default="", metavar="HLO_DIR",
                 help="re-read the cached rows whose compiled program CALIBRATE_HLO_DIR kept in HLO_DIR "
                      "(<row id>.txt.gz) into their cache first, no compile")
  p.add_argument("--cache", default=CACHE, help="folder of the cached compiles (default: benchmarks/calibration); "
                 "rows kept aside from the calibration: --runs benchmarks/heldout_runs.json "
                 "--cache benchmarks/calibration/heldout")
  a = p.parse_args()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  rows = json.load(open(a.runs))
  if a.rows:
    order = a.rows.split(",")
    rows = sorted([r for r in rows if r["id"] in order], key=lambda r: order.index(r["id"]))
  results, unread, stale = evaluate(rows, a.compile, a.layers, a.cache, a.reread)
  text, errors = table(rows, results, unread, stale)
  from shardax.perf import error_bar
  if not a.rows and a.runs == RUNS:   # the whole calibration table: the dry run's error bar reads it (perf/error_bar.py)
    error_bar.write(errors_of(rows, results))
  print(text)
  if errors:
    summary = (f"{len(errors)} of {len(rows)} rows: error factor max(pred/pub, pub/pred) median "
               f"{statistics.median(errors):.2f}x, worst {max(errors):.2f}x")
    families = by_family(rows, results)
    print(summary)
    print("\n".join(families))
    bars = error_bar.summary(errors_of(rows, results))["families"]
    print("\n".join(f"{chip}: {error_bar.COVERAGE:.0%} interval for a new run's pred/pub "
                     + (f"{f['interval'][0]:.2f}x-{f['interval'][1]:.2f}x; leave-one-out: {f['loo_inside']} of "
                        f"{f['loo_checked']} rows inside the interval of the others" if f["interval"] else "none")
                     for chip, f in bars.items()))
    if a.write_docs and a.runs == RUNS:
      _write_docs(text + "\n\n" + summary + "\n\n" + "\n".join(f"* {f}" for f in families))


def _write_docs(body: str) -> None:
  doc = open(DOCS).read()
  block = f"{BEGIN}\n{body}\n{END}"
  if BEGIN in doc:
    doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
  else:
    doc += "\n" + block + "\n"
  with open(DOCS, "w") as f:
    f.write(doc)


if __name__ == "__main__":
  main()
