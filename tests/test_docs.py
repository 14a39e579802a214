"""The docs a newcomer reads stay true to the tree: every relative link in the README and
under docs/ names a file that exists, and the README's synopsis of --mode lists every mode
of main.py's `MODES` table (and no other)."""

import pathlib
import re

from shardax import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages():
  return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_names_a_file_that_exists():
  broken = []
  for page in _pages():
    for target in LINK.findall(page.read_text()):
      if re.match(r"[a-z]+:", target):      # http:, https:, mailto:
        continue
      if not (page.parent / target).exists():
        broken.append(f"{page.relative_to(ROOT)} -> {target}")
  assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_readme_lists_every_mode_of_the_modes_table():
  readme = (ROOT / "README.md").read_text()
  start = readme.index("`--mode` is one of") + len("`--mode` is one of")
  synopsis = readme[start:readme.index("`MODES` table", start)]
  listed = set(re.findall(r"`(\w+)`", synopsis))
  assert listed == set(cli.MODES), (
      f"README's --mode synopsis lists {sorted(listed)}; main.MODES has {sorted(cli.MODES)}")
