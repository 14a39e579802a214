"""The built wheel carries every subpackage and imports the way the editable install does."""

import os
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def subpackages() -> set[str]:
  found = {"shardax"}
  for init in ROOT.rglob("__init__.py"):
    rel = init.parent.relative_to(ROOT)
    if rel.parts and rel.parts[0] not in ("tests", "build", ".venv") and not rel.parts[0].startswith("."):
      found.add(".".join(("shardax",) + rel.parts))
  return found


def test_wheel_contains_every_subpackage(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(tmp_path)], check=True, timeout=300)
  wheel = next(tmp_path.glob("shardax-*.whl"))
  names = zipfile.ZipFile(wheel).namelist()
  packaged = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith("__init__.py")}
  assert subpackages() <= packaged, subpackages() - packaged
  assert not any(n.startswith("shardax/tests/") for n in names)
  assert any(n.endswith("entry_points.txt") for n in names)


def test_a_folder_named_shardax_where_it_runs_is_named_in_the_error(tmp_path):
  """Issue 32: `make run`'s old job dir /tmp/shardax/lm.tiny made `python -m shardax.main`,
  run from /tmp, fail with "no experiment is registered". An editable install finds shardax
  through a finder Python consults after sys.path, and `python -m` puts the working
  directory first on sys.path, so the folder shardax/ there became the package. Reproduced
  with setuptools' own editable finder pointed at this checkout (a PYTHONPATH entry cannot
  reproduce it: a regular package on sys.path beats an earlier namespace folder)."""
  from setuptools.command.editable_wheel import _finder_template
  (tmp_path / "shardax" / "lm.tiny").mkdir(parents=True)
  site = tmp_path / "site"
  site.mkdir()
  (site / "shardax_test_finder.py").write_text(_finder_template("shardax_test_finder", {"shardax": str(ROOT)}, {}))
  boot = "\n".join([
      "import runpy, sys",
      # this environment's own install of shardax, if any, makes way for the one under test
      "sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]",
      f"sys.path.append({str(site)!r})",
      "import shardax_test_finder; shardax_test_finder.install()",
      "sys.argv = ['shardax', '--exp=lm.tiny', '--job_dir=shardax/lm.tiny', '--set', 'train.steps=1']",
      "runpy.run_module('shardax.main', run_name='__main__', alter_sys=True)"])
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  out = subprocess.run([sys.executable, "-c", boot], cwd=tmp_path, env=dict(env, JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  assert (f"'shardax' was imported from {tmp_path / 'shardax'}, a folder named like the package"
          in out.stderr and "run from another directory, or rename that folder" in out.stderr), out.stderr[-2000:]
  assert os.listdir(tmp_path / "shardax") == ["lm.tiny"] and not os.listdir(tmp_path / "shardax" / "lm.tiny")
