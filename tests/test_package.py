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
