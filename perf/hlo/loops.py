"""The loops of a compiled module: each `while`, its condition, body, trip count and state.

A loop's trip count is the compiler's `known_trip_count` (backend_config) when it wrote
one (the CPU compiler does); else it is read from the loop itself (the TPU compiler omits
it): the condition is `i < N` on one tuple element i, and the body adds a constant c to i
each time (1 for a jax scan; 2 for the TPU compiler's bidirectional windowed einsum
loops), so the trip count is ceil(N / c) from i = 0. A loop whose count cannot be read
has none (callers count it once).
"""

from __future__ import annotations

import dataclasses

from shardax.perf.hlo.module import Array, Instruction, Module

_COUNTERS = ("s32", "u32", "s64", "u64")


@dataclasses.dataclass(frozen=True)
class While:
  """One `while` instruction: the computation holding it, its condition and body."""
  instruction: Instruction
  condition: str
  body: str
  trip_count: int | None        # None: not readable

  @property
  def computation(self) -> str:
    return self.instruction.computation

  def stacked(self, trip: int) -> int:
    """Arrays of the loop state whose leading dim is `trip` (a scan over layers carries its
    stacked weights, gradients and moments as [L, ...] arrays)."""
    return sum(a.dims[0] == trip for a in self.instruction.results if a.dims)


def whiles(mod: Module) -> list[While]:
  """Every `while` of `mod`, computations in file order, each in schedule order."""
  out = []
  for inst in mod:
    if inst.opcode != "while" or not (body := inst.attr("body").lstrip("%")):
      continue
    out.append(While(inst, inst.attr("condition").lstrip("%"), body, _trip_count(mod, inst, body)))
  return out


def trip_counts(mod: Module) -> dict[str, int]:
  """Loop body -> how many times it runs per execution of its `while` (readable ones only)."""
  return {w.body: w.trip_count for w in whiles(mod) if w.trip_count is not None}


def _trip_count(mod: Module, loop: Instruction, body: str) -> int | None:
  known = loop.backend_config.get("known_trip_count", {})
  if isinstance(known, dict) and str(known.get("n", "")).isdigit():
    return int(known["n"])
  cond = mod.computations.get(loop.attr("condition").lstrip("%"))
  bound = _bound(cond.instructions) if cond else None
  if bound is None:
    return None
  n, index = bound
  step = _increment(mod.computations[body].instructions if body in mod.computations else [], index)
  return max(1, -(-n // step))


def _int_scalar(i: Instruction) -> bool:
  return len(i.results) == 1 and not i.is_tuple and i.results[0].dims == () and i.results[0].dtype in _COUNTERS


def _constants(comp: list[Instruction]) -> dict[str, int]:
  return {i.name: int(i.operand_text) for i in comp
          if i.opcode == "constant" and _int_scalar(i) and i.operand_text.isdigit()}


def _bound(cond: list[Instruction]) -> tuple[int, int | None] | None:
  """(N, tuple index of i) of a condition computation `i < N`."""
  consts = _constants(cond)
  gtes = {i.name: int(i.attr("index")) for i in cond if i.opcode == "get-tuple-element" and _int_scalar(i)}
  for i in cond:
    if (i.root and i.opcode == "compare" and i.attr("direction") == "LT" and i.results == (Array("pred", ()),)
        and len(i.operands) == 2 and i.operands[1] in consts):
      return consts[i.operands[1]], gtes.get(i.operands[0])
  return None


def _increment(body: list[Instruction], index: int | None) -> int:
  """What one pass of a loop body adds to tuple element `index` (its counter); 1 if unclear.

  The next counter is the ROOT tuple's element `index`: a chain of adds of constants
  back to the counter read from the parameter (two adds when the compiler unrolled
  the loop by two).
  """
  if index is None:
    return 1
  consts = _constants(body)
  counter = {i.name for i in body if i.opcode == "get-tuple-element" and _int_scalar(i) and i.attr("index") == str(index)}
  for i in body:  # copies and bitcasts of the counter are the counter
    if i.opcode in ("copy", "bitcast") and _int_scalar(i) and i.operands and i.operands[0] in counter:
      counter.add(i.name)
  adds = {i.name: i.operands for i in body if i.opcode == "add" and _int_scalar(i) and len(i.operands) == 2}
  root = next((i for i in body if i.root and i.opcode == "tuple"), None)
  args = root.operands if root else ()
  name, step = (args[index] if index < len(args) else None), 0
  for _ in range(8):
    if name in counter:
      return max(1, step)
    if name not in adds:
      return 1
    x, y = adds[name]
    x, y = (y, x) if x in consts else (x, y)
    if y not in consts:
      return 1
    step, name = step + consts[y], x
  return 1
