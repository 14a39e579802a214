"""Compiled HLO text cut into its computations: the one reader of where each begins and ends.

A computation begins at its header (`[ENTRY] %name (params) -> result {`) and ends on a
bare `}` or on `}, execution_thread=...` (v6e programs close their SparseCore computations
that way; read as still open, the entry after one was swallowed). Lines inside a
computation may start with `}}` (custom-call configs), so only a header seen outside every
computation opens one. The report (collectives, trip counts) and the loop-aware costs
(perf/costs.py) both read computations through `split`; the report and the buffer
list (perf/buffers.py) read an op's name and source line through `Sources`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
# An instruction's metadata={...}: quoted values may hold braces (op names of nested jits).
_METADATA = re.compile(r'metadata=\{((?:[^}"]|"(?:[^"\\]|\\.)*")*)\}')
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\d+)')
_NUMBERS = re.compile(r"(\w+)=(\d+)")
# Frames that wrap every matmul or annotation: the source shown is the first frame outside them.
_GENERIC = ("layers/quantization.py", "layers/linear.py", "sharding/")


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


def short_path(path: str) -> str:
  """A source path relative to the shardax package, else the file's last two parts."""
  parts = path.split("/")
  if "shardax" in parts:
    return "/".join(parts[len(parts) - parts[::-1].index("shardax"):])
  return "/".join(parts[-2:])


def _table(hlo_text: str, name: str) -> dict[int, str]:
  m = re.search(rf"^{name}\n(.*?)(?:\n\n|\n(?=[A-Z%]))", hlo_text, re.S | re.M)
  rows = (line.split(None, 1) for line in (m.group(1).splitlines() if m else []) if line.strip())
  return {int(r[0]): r[1].strip() for r in rows if len(r) == 2 and r[0].isdigit()}


def _model_code(path: str) -> bool:
  return "/shardax/" in path and "site-packages" not in path and not any(g in path for g in _GENERIC)


def stack_frames(hlo_text: str) -> dict[int, str]:
  """{stack frame id: 'file.py:line function'} from the module's FileNames / FunctionNames /
  FileLocations / StackFrames tables (jax >= 0.7 writes an op's metadata as stack_frame_id,
  its innermost frame). Walking out from it, the first frame of shardax model code outside
  the generic matmul/annotation wrappers (_GENERIC), so a dot reads as the layer that made
  it; else the first frame outside site-packages (user code, not jax/flax/optax); else the
  innermost. The printed parent_frame_id is the parent's id + 1 (1: none), seen on libtpu
  0.0.42.1 dumps and the CPU compiler of jax 0.10: parent - 1 walks attend -> logits ->
  forward -> loss_and_metrics -> the train step."""
  files = {i: s.strip('"') for i, s in _table(hlo_text, "FileNames").items()}
  funcs = {i: s.strip('"') for i, s in _table(hlo_text, "FunctionNames").items()}
  locations = {i: dict(_NUMBERS.findall(s)) for i, s in _table(hlo_text, "FileLocations").items()}
  frames = {}
  for i, s in _table(hlo_text, "StackFrames").items():
    f = dict(_NUMBERS.findall(s))
    if loc := locations.get(int(f.get("file_location_id", 0))):
      path = files.get(int(loc.get("file_name_id", 0)), "?")
      where = f"{short_path(path)}:{loc.get('line', '?')} {funcs.get(int(loc.get('function_name_id', 0)), '')}"
      frames[i] = (path, where.strip(), int(f.get("parent_frame_id", 1)) - 1)
  out = {}
  for i in frames:
    chain, j = [], i
    while j in frames and len(chain) < 64:
      chain.append(frames[j])
      j = frames[j][2] if frames[j][2] != j else 0
    ours = [c for c in chain if _model_code(c[0])] or [c for c in chain if "site-packages" not in c[0]]
    out[i] = (ours or chain)[0][1]
  return out


class Sources:
  """(op_name, source line) of an instruction from its metadata: source_file/source_line
  when written (older jax), else its stack_frame_id through `stack_frames` (read once, on
  first need)."""

  def __init__(self, hlo_text: str):
    self._text = hlo_text
    self._frames: dict[int, str] | None = None

  def __call__(self, instruction: str) -> tuple[str, str]:
    """`instruction`: the instruction's text (its line, or the part holding its metadata)."""
    m = _METADATA.search(instruction)
    meta = dict(_FIELD.findall(m.group(1))) if m else {}
    op_name = meta.get("op_name", "").strip('"').replace("\\'", "'")
    if "source_file" in meta:
      return op_name, f"{short_path(meta['source_file'].strip(chr(34)))}:{meta.get('source_line', '?')}"
    if "stack_frame_id" not in meta:
      return op_name, ""
    if self._frames is None:
      self._frames = stack_frames(self._text)
    return op_name, self._frames.get(int(meta["stack_frame_id"]), "")
