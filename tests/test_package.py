"""The built wheel carries every subpackage and every data file the library reads, and
imports the way the editable install does."""

import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = ("tests", "build", "dist", "benchmarks", "docs", ".venv")   # in the checkout, not the package


def subpackages() -> set[str]:
  found = {"shardax"}
  for init in ROOT.rglob("__init__.py"):
    rel = init.parent.relative_to(ROOT)
    if rel.parts and rel.parts[0] not in ("tests", "build", ".venv") and not rel.parts[0].startswith("."):
      found.add(".".join(("shardax",) + rel.parts))
  return found


def package_files() -> list[pathlib.Path]:
  """The package's own files, relative to the root (not the tests, benchmarks, docs or build
  outputs beside it, nor caches)."""
  found = []
  for top, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if d not in OUTSIDE and not d.startswith(".") and d != "__pycache__"
               and not d.endswith(".egg-info")]
    found += [pathlib.Path(top, f).relative_to(ROOT) for f in files if not f.endswith(".pyc")]
  return found


def library_modules() -> list[pathlib.Path]:
  return [ROOT / p for p in package_files() if p.suffix == ".py"]


def data_files_the_library_opens() -> set[pathlib.Path]:
  """Files a library module names by a path built from its own location (`__file__`): every
  module whose source uses `__file__` is imported, and each module-level path that names an
  existing file in the checkout is one it opens (error_bar.ERRORS: the calibration summary)."""
  found = set()
  for path in library_modules():
    if "__file__" not in path.read_text():
      continue
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    module = importlib.import_module(".".join(("shardax",) + parts))
    for value in vars(module).values():
      if isinstance(value, (str, pathlib.Path)) and os.path.isfile(value):
        found.add(pathlib.Path(value).resolve())
  return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The wheel `pip wheel .` builds from a clean copy of this checkout (offline: setuptools from
  this venv). A clean copy: setuptools reads back the file list of an earlier build's
  *.egg-info and build/ here, which would ship a file pyproject.toml no longer declares."""
  src, out = tmp_path_factory.mktemp("src") / "shardax", tmp_path_factory.mktemp("wheel")
  shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__"))
  subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(out)], check=True, timeout=300)
  return next(out.glob("shardax-*.whl"))


def test_wheel_contains_every_subpackage(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  packaged = {os.path.dirname(n).replace("/", ".") for n in names if n.endswith("__init__.py")}
  assert subpackages() <= packaged, subpackages() - packaged
  assert not any(n.startswith("shardax/tests/") for n in names)
  assert any(n.endswith("entry_points.txt") for n in names)


def test_wheel_carries_every_data_file_the_library_opens(wheel):
  """The dry run's calibration error bar once read benchmarks/, which no wheel contains: an
  installed shardax printed 'no summary' where the checkout printed the error bar."""
  names = set(zipfile.ZipFile(wheel).namelist())
  opened = data_files_the_library_opens()
  assert opened, "found no data file the library opens: the search itself is broken"
  for f in opened:
    rel = f.relative_to(ROOT)
    assert not set(rel.parts) & set(OUTSIDE), f"{rel}: the library reads a file outside the package"
    assert f"shardax/{rel.as_posix()}" in names, f"{rel} is not in the wheel: declare it in pyproject.toml package-data"
  # ... and every non-Python file inside a subpackage ships too (data the library may read)
  # (the root's own files are the checkout's: README, Makefile, pyproject.toml, ...)
  shipped = [p for p in package_files() if len(p.parts) > 1 and p.suffix != ".py"]
  missing = [str(p) for p in shipped if f"shardax/{p.as_posix()}" not in names]
  assert not missing, f"in the package's folders but not in the wheel: {missing}"


def test_an_installed_wheel_prints_the_calibration_error_bar(wheel, tmp_path):
  """The wheel installed on its own (no checkout on the path): the error bar finds its rows."""
  target = tmp_path / "site"
  subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                  str(target), str(wheel)], check=True, timeout=300)
  code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
          "if not getattr(f, '__module__', '').startswith('__editable__')]\n"
          "from shardax.perf import hardware, error_bar\n"
          "print(error_bar.ERRORS); print(error_bar.for_chip(hardware.lookup('TPU v4'))['line'])")
  env = dict(os.environ, PYTHONPATH=str(target), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  where, line = out.stdout.splitlines()[-2:]
  assert where.startswith(str(target)), where
  assert "published runs): error median" in line, line


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
