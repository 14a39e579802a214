"""benchmarks/calibrate.py --reread: a cached row is re-read from the compiled program that
CALIBRATE_HLO_DIR kept, when how programs are read changes, without compiling it again."""

import gzip
import importlib.util
import json
import os
import shutil

from shardax.perf import costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = "maxtext-v5e-128B-1xv5e-256"
PROGRAM = os.path.join(ROOT, "tests", "fixtures", "peeled_offload", "layers_3.hlo.gz")   # any kept TPU program


def _calibrate():
  spec = importlib.util.spec_from_file_location("calibrate", os.path.join(ROOT, "benchmarks", "calibrate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_a_kept_program_replaces_the_cached_costs_and_keeps_the_compiles_record(tmp_path):
  cal = _calibrate()
  row = next(r for r in json.load(open(os.path.join(ROOT, "benchmarks", "heldout_runs.json"))) if r["id"] == ROW)
  cache, kept = tmp_path / "cache", tmp_path / "hlo"
  cache.mkdir(), kept.mkdir()
  shutil.copy(os.path.join(ROOT, "benchmarks", "calibration", "heldout", f"{ROW}.json"), cache)
  was = json.load(open(cache / f"{ROW}.json"))
  cal.evaluate([row], cache=str(cache))   # nothing kept given: the cache is read as it is
  assert json.load(open(cache / f"{ROW}.json")) == was
  with gzip.open(PROGRAM, "rt") as src, gzip.open(kept / f"{ROW}.txt.gz", "wt") as dst:
    dst.write(src.read())
  cal.evaluate([row], cache=str(cache), hlo_dir=str(kept))
  now = json.load(open(cache / f"{ROW}.json"))
  with gzip.open(PROGRAM, "rt") as f:
    assert now["costs"] == json.loads(json.dumps(costs.to_json(costs.of_hlo_text(f.read()))))
  assert now["costs"] != was["costs"]
  for key in ("layers", "compile_seconds", "compile_cpu_seconds", "libtpu_flags", "attention", "remat"):
    assert now[key] == was[key], key
