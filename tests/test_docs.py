"""The docs a newcomer reads stay true to the tree: every relative link in the README and
under docs/ names a file that exists, and the README's synopsis of --mode lists every mode
of main.py's `MODES` table (and no other), and code that cites a docs section by name cites a
heading that exists."""

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


CITATION = re.compile(r"docs/([a-z0-9_/]+\.md)(?:'s)?,?[ \t]*\(?[\"']([^\"'\n]{3,})[\"']")


def test_code_that_cites_a_docs_section_by_name_names_a_heading_that_exists():
  """A docstring or comment citing `docs/X.md, "Section"` (or `docs/X.md 'Section'`) on one
  line points at a heading of X that starts with that name, so renaming a section cannot
  leave the code citing one that is gone."""
  stale = []
  for path in sorted(ROOT.rglob("*.py")):
    if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
      continue
    for doc, section in CITATION.findall(path.read_text()):
      page = ROOT / "docs" / doc
      headings = ([line.lstrip("#").strip() for line in page.read_text().splitlines()
                   if line.startswith("#")] if page.exists() else [])
      if not any(h.startswith(section) for h in headings):
        stale.append(f"{path.relative_to(ROOT)} cites docs/{doc} \"{section}\"")
  assert not stale, ("code cites docs sections that do not exist (cite the heading as it is "
                     "now, or the results file the text moved to):\n" + "\n".join(stale))
