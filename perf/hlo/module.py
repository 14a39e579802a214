"""A compiled module's text as computations of instruction records, read once.

Text forms read (CPU, GPU and TPU compilers of jax 0.10/0.11, libtpu 0.0.42):

  HloModule name, entry_computation_layout={...}, num_partitions=8
  <source tables: FileNames, FunctionNames, FileLocations, StackFrames>
  %fused_computation (param_0: f32[8]) -> f32[8] {
    %param_0 = f32[8]{0} parameter(0)
    ROOT %add = f32[8]{0} add(%param_0, %param_0), metadata={op_name="..."}
  }
  ENTRY %main (...) -> (...) {
    %ar = (f32[8]{0}, u32[]) all-reduce-start(f32[8]{0} %x), replica_groups=[2,4]<=[8], to_apply=%add
  }, execution_thread="sparsecore"

A computation begins at a header seen outside every computation and ends on a bare `}`
or on `}, execution_thread=...` (lines inside may start with `}}`: custom-call configs).
An instruction is `[ROOT] [%]name = <shape> <opcode>(<operands>)[, key=value]...`: the
shape an array `f32[8,16]{1,0:T(8,128)}` or a tuple `(f32[8]{0}, u32[])` (nested),
operands with or without their shapes written, attributes split at top-level commas
(braces, brackets, parentheses and quotes respected) and kept as written. `%` prefixes
are optional everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Iterator

from shardax.perf.hlo import dtypes, groups

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_NAME = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_REF = re.compile(r"%?([\w.\-]+)\s*$")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\d+)')
_LEAF = re.compile(r"\b[a-z][a-z0-9]*\[[0-9,]*\](\{[^{}]*\})?")   # any leaf of a shape, with its layout
_SPACE = re.compile(r"S\((\d+)\)")                                   # a layout's memory space
_ALIAS = re.compile(r"\{([0-9]*)[0-9,]*\}\s*:\s*\(\s*([0-9]+)")          # {output index}: (operand, ...)   # metadata={op_name="..." stack_frame_id=7}
# Attributes that name one called computation, and those that name a list of them.
CALL_KEYS = ("calls", "to_apply", "body", "condition", "true_computation", "false_computation")
CALL_LIST_KEYS = ("branch_computations", "called_computations")


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of a shape: element type (HLO spelling) and dims."""
  dtype: str
  dims: tuple[int, ...]

  @property
  def nbytes(self) -> int:
    return dtypes.nbytes(self.dtype, self.dims)


def arrays(shape_text: str) -> tuple[Array, ...]:
  """Every array written in `shape_text` (a shape, or a tuple of them), in order."""
  return tuple(Array(t, tuple(int(d) for d in dims.split(",") if d))
               for t, dims in _ARRAY.findall(shape_text) if t in dtypes.BYTES)


def memory_spaces(shape_text: str) -> list[int]:
  """The memory space of each leaf of a shape as written, tokens included, in order (the
  `S(n)` of its layout; 0 where the layout names none). TPU: 1 is on-chip memory."""
  out = []
  for m in _LEAF.finditer(shape_text):
    space = _SPACE.search(m.group(1) or "")
    out.append(int(space.group(1)) if space else 0)
  return out


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  shape: str                      # the result shape as written (layouts included)
  operand_text: str               # inside the call's parentheses, as written
  attributes: dict[str, str]      # key -> value as written (metadata, backend_config included)
  computation: str                # the computation holding it
  root: bool = False
  line: str = ""

  @functools.cached_property
  def results(self) -> tuple[Array, ...]:
    """The result's arrays (a tuple's leaves, in order)."""
    return arrays(self.shape)

  @property
  def result_bytes(self) -> int:
    return sum(a.nbytes for a in self.results)

  @property
  def is_tuple(self) -> bool:
    return self.shape.startswith("(")

  @functools.cached_property
  def operand_pieces(self) -> tuple[str, ...]:
    return tuple(p.strip() for p in split_top(self.operand_text) if p.strip())

  @functools.cached_property
  def operands(self) -> tuple[str, ...]:
    """Names of the operand instructions, in order (literals, e.g. a constant's, left out)."""
    return tuple(m.group(1) for p in self.operand_pieces if "%" in p and (m := _REF.search(p)))

  @functools.cached_property
  def inline_operand_arrays(self) -> tuple[Array, ...]:
    """The operands' arrays where the printer wrote their shapes (older jax), else ()."""
    return arrays(self.operand_text)

  @functools.cached_property
  def called(self) -> tuple[str, ...]:
    """Computations this instruction calls (fusion, reduction, loop, branches, async), in order."""
    out = []
    for key in CALL_KEYS:
      if key in self.attributes:
        out.append(self.attributes[key].strip().lstrip("%"))
    for key in CALL_LIST_KEYS:
      if key in self.attributes:
        out += [c.strip().lstrip("%") for c in self.attributes[key].strip("{}").split(",") if c.strip()]
    return tuple(out)

  def attr(self, key: str, default: str = "") -> str:
    return self.attributes.get(key, default)

  @functools.cached_property
  def metadata(self) -> dict[str, str]:
    """The `metadata={...}` fields (op_name, source_file, source_line, stack_frame_id), quotes
    taken off string values, escapes kept as written."""
    return {k: v[1:-1] if v.startswith('"') else v for k, v in _FIELD.findall(self.attributes.get("metadata", ""))}

  @functools.cached_property
  def frontend_attributes(self) -> dict[str, str]:
    """The `frontend_attributes={k="v",...}` entries, quotes taken off the values."""
    out = {}
    for part in split_top(self.attributes.get("frontend_attributes", "").strip()[1:-1]):
      key, eq, value = part.partition("=")
      if eq:
        value = value.strip()
        out[key.strip()] = value[1:-1] if len(value) > 1 and value[0] == value[-1] == '"' else value
    return out

  @functools.cached_property
  def backend_config(self) -> dict:
    """The `backend_config=` attribute read as JSON ({} when absent or not JSON)."""
    try:
      config = json.loads(self.attributes.get("backend_config", ""))
    except ValueError:
      return {}
    return config if isinstance(config, dict) else {}

  @functools.cached_property
  def aliasing(self) -> tuple[frozenset[int], frozenset[int]]:
    """(operand indices, top-level output indices) that `output_to_operand_aliasing` pairs:
    buffers the instruction updates in place."""
    pairs = _ALIAS.findall(self.attr("output_to_operand_aliasing"))
    return frozenset(int(k) for _, k in pairs), frozenset(int(o) for o, _ in pairs if o)

  @property
  def replica_groups(self) -> str:
    """The `replica_groups=` / `source_target_pairs=` attribute as written ("" if none)."""
    return groups.attribute(self.line)

  def device_groups(self, num_devices: int) -> list[list[int]]:
    """The device groups (partition ids) this collective talks in (perf/hlo/groups.py)."""
    return groups.groups(self.line, num_devices)


@dataclasses.dataclass
class Computation:
  name: str
  entry: bool
  lines: list[str]                # header first, closing brace last, as written
  instructions: list[Instruction]

  @property
  def root(self) -> Instruction | None:
    return next((i for i in self.instructions if i.root), self.instructions[-1] if self.instructions else None)


@dataclasses.dataclass
class Module:
  header: str                     # the HloModule line ("" for a fragment)
  prefix: str                     # text before the first computation (source tables), header left out
  computations: dict[str, Computation]
  entry: str                      # "" when the text has none

  @functools.cached_property
  def instructions(self) -> dict[str, Instruction]:
    """Every instruction by name (names are unique in a module)."""
    return {i.name: i for c in self.computations.values() for i in c.instructions}

  @functools.cached_property
  def users(self) -> dict[str, list[Instruction]]:
    """name -> the instructions that take it as an operand (once each, in file order)."""
    out: dict[str, list[Instruction]] = {}
    for i in self:
      for o in dict.fromkeys(i.operands):
        out.setdefault(o, []).append(i)
    return out

  def __iter__(self) -> Iterator[Instruction]:
    """Every instruction, computations in file order, each in schedule order."""
    for c in self.computations.values():
      yield from c.instructions

  @property
  def num_partitions(self) -> int | None:
    m = _PARTITIONS.search(self.header)
    return int(m.group(1)) if m else None

  def reachable(self, roots) -> set[str]:
    """The computations `roots` name and every computation they call, transitively."""
    seen: set[str] = set()
    stack = list(roots)
    while stack:
      c = stack.pop()
      if c in seen or c not in self.computations:
        continue
      seen.add(c)
      stack.extend(x for i in self.computations[c].instructions for x in i.called)
    return seen

  @functools.cached_property
  def fused(self) -> frozenset[str]:
    """Computations that run inside one instruction (fusion bodies, reductions' `to_apply`, and
    what those call), as opposed to those run op by op (the entry, loop bodies, plain calls):
    XLA prices their bytes as their caller's."""
    return frozenset(self.reachable(c for i in self if i.opcode == "fusion" or "to_apply" in i.attributes
                                    for c in i.called))

  @functools.cached_property
  def async_done(self) -> dict[str, str]:
    """Async pairs: each `-start`'s name -> its `-done`'s name (a done's operand is its start)."""
    return {i.operands[0]: i.name for i in self if i.opcode.endswith("-done") and i.operands}

  def wrapped_opcode(self, inst: Instruction) -> str:
    """What an async op runs: `all-gather` for `all-gather-start`, the called computation's
    root opcode for `async-start` (e.g. an all-reduce wrapped in an async computation)."""
    if inst.opcode in ("async-start", "async-update", "async-done") and inst.called:
      comp = self.computations.get(inst.called[0])
      return comp.root.opcode if comp and comp.root else inst.opcode
    return inst.opcode.removesuffix("-start").removesuffix("-done")

  def operand_arrays(self, inst: Instruction) -> tuple[Array, ...]:
    """An instruction's operands' arrays: written inline, else each operand's definition's."""
    return inst.inline_operand_arrays or tuple(
        a for o in inst.operands if o in self.instructions for a in self.instructions[o].results)


_TILED_LAYOUT = re.compile(r"\{([\d,]*):[^}]*\}")  # {minor_to_major:T(...)S(...)}


def logical_layouts(text: str) -> str:
  """HLO text with layouts cut to their dim order: tiles and memory spaces go
  (`{1,0:T(8,128)S(1)}` -> `{1,0}`), and a scalar's layout (`{:S(2)}`) goes entirely."""
  return _TILED_LAYOUT.sub(lambda m: "{" + m.group(1) + "}" if m.group(1) else "", text)


def _scan(text: str, start: int = 0, depth: int = 0):
  """(index, char, bracket depth after it) of each character of `text` from `start` that is
  outside double quotes (a backslash escapes the next character inside them)."""
  quoted, i = False, start
  while i < len(text):
    ch = text[i]
    if quoted:
      if ch == "\\":
        i += 1
      elif ch == '"':
        quoted = False
    elif ch == '"':
      quoted = True
    else:
      depth += (ch in "([{") - (ch in ")]}")
      yield i, ch, depth
    i += 1


def split_top(text: str, sep: str = ",") -> list[str]:
  """`text` split at `sep` outside brackets, braces, parentheses and double quotes."""
  parts, start = [], 0
  for i, ch, depth in _scan(text):
    if ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


def _closing(text: str, start: int) -> int:
  """Index of the bracket closing the one opened just before `start` (len(text) if none)."""
  for i, _, depth in _scan(text, start, 1):
    if depth == 0:
      return i
  return len(text)


def instruction(line: str, computation: str = "") -> Instruction | None:
  """The record of one instruction line; None for anything else (headers, braces, blank)."""
  m = _NAME.match(line)
  if not m:
    return None
  pos = m.end()
  if line.startswith("(", pos):
    end = _closing(line, pos + 1) + 1
  else:
    end = pos
    while end < len(line) and not line[end].isspace():
      end += 1
  shape = line[pos:end]
  op = _OPCODE.match(line, end)
  if not op:
    return None
  close = _closing(line, op.end())
  attributes = {}
  for part in split_top(line[close + 1:]):
    key, eq, value = part.strip().partition("=")
    if eq and key:
      attributes[key.strip()] = value.strip()
  return Instruction(m.group(2), op.group(1), shape, line[op.end():close], attributes, computation,
                     bool(m.group(1)), line)


def _closes(line: str) -> bool:
  return line.rstrip() == "}" or line.startswith("}, execution_thread=")


def parse(text: str) -> Module:
  """`text` (`compiled.as_text()`, or a fragment of it: instructions without a computation
  header are read as one computation named "") as a Module."""
  comps: dict[str, Computation] = {}
  header, prefix, current, entry = "", [], None, ""
  for line in text.splitlines():
    if current is None:
      if h := _HEADER.match(line):
        current = Computation(h.group(2), bool(h.group(1)), [line], [])
        entry = current.name if h.group(1) else entry
        comps[current.name] = current
      elif line.startswith("HloModule"):
        header = line
      elif not comps:
        prefix.append(line)
      continue
    current.lines.append(line)
    if _closes(line):
      current = None
    elif inst := instruction(line, current.name):
      current.instructions.append(inst)
  if not comps:  # a bare fragment
    loose = [i for line in prefix if (i := instruction(line, ""))]
    if loose:
      comps[""] = Computation("", False, [], loose)
  return Module(header, "\n".join(prefix), comps, entry)
