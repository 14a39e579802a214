"""Dump every experiment's built config as JSON, and compare two dumps.

A refactor of experiments/ or configs/shapes.py that should change no experiment is checked by
dumping before, dumping after and comparing:

    python benchmarks/experiment_configs.py dump /tmp/exp_before
    ... edit ...
    python benchmarks/experiment_configs.py dump /tmp/exp_after
    python benchmarks/experiment_configs.py diff /tmp/exp_before /tmp/exp_after

or in one step while other files change too (others' edits land in both trees):

    python benchmarks/experiment_configs.py against REV experiments configs/shapes.py

which dumps the working tree, and a copy of it whose named paths are as at git revision REV,
and compares the two.

The dump covers every registered experiment (`configs.registry.names()`), the `hf:` prefix on
each Hugging Face fixture directory (tests/fixtures/hf/*), and every published row the
calibration can rebuild (experiments/calibration.py `from_row` over
shared/published-runs/calibration.json, when that file is there). `diff` exits 1 and names
each experiment that is missing, added or different (with a unified diff of its JSON).
"""

from __future__ import annotations

import difflib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HF_FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
RUNS = os.path.join(os.path.dirname(ROOT), "shared", "published-runs", "calibration.json")


def configs_json() -> dict[str, str]:
  """Experiment name -> its built config as JSON (registry.to_json)."""
  from shardax import configs
  from shardax.configs import registry
  from shardax.experiments import calibration
  out = {name: registry.to_json(registry.resolve(name)) for name in registry.names()}
  for d in sorted(glob.glob(os.path.join(HF_FIXTURES, "*", "config.json"))):
    name = f"hf:{os.path.dirname(d)}"
    try:
      out[name] = registry.to_json(registry.resolve(name))
    except ValueError as e:   # a fixture of an architecture not (yet) imported: record the message
      out[name] = f"error: {e}"
  if os.path.exists(RUNS):
    with open(RUNS) as f:
      rows = json.load(f)
    for row in rows:
      try:
        cfg = calibration.from_row(row)
      except ValueError as e:   # Unexpressible and unknown topologies: record the message
        out[f"calibration.{row.get('id', '?')}"] = f"error: {e}"
        continue
      out[cfg.name] = registry.to_json(configs.build(cfg))
  return out


def _file(name: str) -> str:
  return name.replace("/", "_").replace(":", "_") + ".json"


def dump(directory: str) -> None:
  os.makedirs(directory, exist_ok=True)
  found = configs_json()
  for name, text in found.items():
    with open(os.path.join(directory, _file(name)), "w") as f:
      f.write(text)
  print(f"{len(found)} experiment configs written to {directory}")


def diff(before: str, after: str) -> int:
  a = {os.path.basename(p): p for p in glob.glob(os.path.join(before, "*.json"))}
  b = {os.path.basename(p): p for p in glob.glob(os.path.join(after, "*.json"))}
  bad = same = 0
  for name in sorted(a.keys() | b.keys()):
    if name not in b or name not in a:
      print(f"{name}: only in {before if name in a else after}")
      bad += 1
      continue
    old, new = (open(p).read().splitlines() for p in (a[name], b[name]))
    same += old == new
    if old != new:
      bad += 1
      print(f"{name}: differs")
      print("\n".join(difflib.unified_diff(old, new, "before", "after", lineterm="", n=1)))
  print(f"{same} identical, {bad} missing, added or different")
  return 1 if bad else 0


def against(rev: str, paths: list[str]) -> int:
  """Diff the working tree's dump against that of a copy with `paths` as at `rev`."""
  git = lambda *a: subprocess.run(["git", "-C", ROOT, *a], check=True, capture_output=True, text=True).stdout
  with tempfile.TemporaryDirectory() as tmp:
    copy = os.path.join(tmp, "pkg", "shardax")
    for f in git("ls-files", "-co", "--exclude-standard").splitlines():
      if os.path.isfile(os.path.join(ROOT, f)) and not f.startswith(".venv"):
        os.makedirs(os.path.dirname(os.path.join(copy, f)), exist_ok=True)
        shutil.copy(os.path.join(ROOT, f), os.path.join(copy, f))
    for path in paths:
      target = os.path.join(copy, path)
      if os.path.isdir(target):
        shutil.rmtree(target)
      elif os.path.exists(target):
        os.remove(target)
      for f in git("ls-tree", "-r", "--name-only", rev, "--", path).splitlines():
        os.makedirs(os.path.dirname(os.path.join(copy, f)), exist_ok=True)
        with open(os.path.join(copy, f), "w") as out:
          out.write(git("show", f"{rev}:{f}"))
    env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "pkg"), JAX_PLATFORMS="cpu")
    before, after = os.path.join(tmp, "before"), os.path.join(tmp, "after")
    subprocess.run([sys.executable, os.path.abspath(__file__), "dump", before], env=env, cwd=tmp, check=True)
    dump(after)
    return diff(before, after)


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "dump":
    dump(sys.argv[2])
  elif len(sys.argv) == 4 and sys.argv[1] == "diff":
    sys.exit(diff(sys.argv[2], sys.argv[3]))
  elif len(sys.argv) >= 4 and sys.argv[1] == "against":
    sys.exit(against(sys.argv[2], sys.argv[3:]))
  else:
    sys.exit(__doc__)
