"""Compiled HLO text cut into its computations: the one reader of where each begins and ends.

A computation begins at its header (`[ENTRY] %name (params) -> result {`) and ends on a
bare `}` or on `}, execution_thread=...` (v6e programs close their SparseCore computations
that way; read as still open, the entry after one was swallowed). Lines inside a
computation may start with `}}` (custom-call configs), so only a header seen outside every
computation opens one. The report (collectives, trip counts) and the loop-aware costs
(trainer/perf/costs.py) both read computations through `split`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Computations:
  prefix: str                     # text before the first computation (source tables), HloModule line left out
  blocks: dict[str, list[str]]    # computation -> its lines in file order: header first, closing brace last
  entry: str                      # the ENTRY computation; "" when the text has none

  def lines(self) -> Iterator[tuple[str, str]]:
    """(computation, line) for every line inside a computation, headers left out; the lines
    of a bare fragment (instructions without any computation header) under ""."""
    if not self.blocks:
      yield from (("", line) for line in self.prefix.splitlines())
    for name, block in self.blocks.items():
      yield from ((name, line) for line in block[1:])


def _closes(line: str) -> bool:
  return line.rstrip() == "}" or line.startswith("}, execution_thread=")


def split(hlo_text: str) -> Computations:
  """`hlo_text` (`compiled.as_text()`, or a fragment of it) by computation."""
  blocks: dict[str, list[str]] = {}
  prefix, current, entry = [], None, ""
  for line in hlo_text.splitlines():
    if current is None:
      if h := _HEADER.match(line):
        current = h.group(2)
        entry = current if h.group(1) else entry
        blocks[current] = [line]
      elif not blocks and not line.startswith("HloModule"):
        prefix.append(line)
      continue
    blocks[current].append(line)
    if _closes(line):
      current = None
  return Computations("\n".join(prefix), blocks, entry)
