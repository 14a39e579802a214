"""What the compiler did: collectives, memory, FLOPs, and where each parameter lives.

Everything here reads a compiled program (`jax.jit(f).lower(...).compile()`), so
it reports what will run, not what we hoped for. Collective bytes are the size
of the full buffer the op moves data for: the result of an all-reduce or
all-gather, the operand of a reduce-scatter, the buffer of an all-to-all or
collective-permute. Async forms (`all-gather-start`, ...) count once; the
matching `-done` ops are not counted.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Iterable

import jax
import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?(\S+)\s*=\s*(.*?)\s("
                 + "|".join(COLLECTIVE_KINDS) + r")(-start)?\((.*)$")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_META = re.compile(r'(op_name|source_file)="([^"]*)"|source_line=(\d+)')


def _bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def _operands(rest: str) -> str:
  """The operand list of an instruction: text up to the parenthesis that closes the call."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return rest[:i]
  return rest


@dataclasses.dataclass(frozen=True)
class Collective:
  name: str
  kind: str
  bytes: int
  group_size: int
  op_name: str = ""
  source: str = ""


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op in compiled HLO text."""
  found = []
  for line in hlo_text.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    name, result, kind, is_start, rest = m.groups()
    operands = _operands(rest)
    result_b, operand_b = _bytes(result), _bytes(operands)
    if is_start:  # async start returns (operands..., results..., context): keep the results
      result_b = max(result_b - operand_b, 0)
    nbytes = operand_b if kind == "reduce-scatter" else max(result_b, operand_b)
    group = 0
    if g := _GROUPS_IOTA.search(rest):
      group = int(g.group(1).split(",")[-1])
    elif g := _GROUPS_LIST.search(rest):
      group = len([t for t in g.group(1).split(",") if t])
    elif kind == "collective-permute":
      group = 2
    meta = {"op_name": "", "source_file": "", "source_line": ""}
    for key, val, line_no in _META.findall(rest):
      if key:
        meta[key] = val
      else:
        meta["source_line"] = line_no
    source = f"{meta['source_file']}:{meta['source_line']}" if meta["source_file"] else ""
    found.append(Collective(name, kind, nbytes, group, meta["op_name"], source))
  return found


def collective_summary(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {"count": n, "bytes": b}} for each collective kind present."""
  summary: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for c in collectives(hlo_text):
    summary[c.kind]["count"] += 1
    summary[c.kind]["bytes"] += c.bytes
  return dict(summary)


def memory(compiled) -> dict[str, int]:
  """Per-device bytes from the compiler's memory analysis."""
  m = compiled.memory_analysis()
  if m is None:
    return {}
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes", "generated_code_size_in_bytes")
  out = {k.replace("_size_in_bytes", "_bytes"): int(getattr(m, k, 0) or 0) for k in keys}
  # Donated outputs alias their inputs and need no new memory.
  out["peak_estimate_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                                + out["temp_bytes"])
  return out


def flops(compiled) -> float:
  """FLOPs per device of one call, from the compiler's cost analysis (0 if unknown)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


@dataclasses.dataclass(frozen=True)
class ParamRow:
  path: str
  shape: tuple[int, ...]
  logical_axes: tuple[Any, ...]
  spec: str
  bytes_per_device: int
  bytes_total: int


def param_table(params: Any, shardings: Any, logical_axes: Any) -> list[ParamRow]:
  """One row per parameter: three pytrees of the same structure (arrays or shape structs)."""
  flat_p = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_s = jax.tree.leaves(shardings)
  flat_a = jax.tree.leaves(logical_axes, is_leaf=lambda x: isinstance(x, tuple))
  rows = []
  for (path, leaf), sharding, axes in zip(flat_p, flat_s, flat_a, strict=True):
    shape = tuple(leaf.shape)
    item = np.dtype(leaf.dtype).itemsize
    local = sharding.shard_shape(shape) if sharding is not None else shape
    rows.append(ParamRow(jax.tree_util.keystr(path, simple=True, separator="/"), shape,
                         tuple(axes), str(getattr(sharding, "spec", "")),
                         math.prod(local) * item, math.prod(shape) * item))
  return rows


def format_param_table(rows: Iterable[ParamRow]) -> str:
  rows = list(rows)
  header = ("parameter", "shape", "logical axes", "spec", "bytes/device")
  body = [(r.path, str(r.shape), str(r.logical_axes), r.spec, f"{r.bytes_per_device:,}") for r in rows]
  total = sum(r.bytes_per_device for r in rows)
  body.append(("total", "", "", "", f"{total:,}"))
  widths = [max(len(x[i]) for x in [header] + body) for i in range(len(header))]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in body])


def format_collectives(summary: dict[str, dict[str, int]]) -> str:
  if not summary:
    return "collectives: none"
  lines = ["collective            count          bytes"]
  for kind in sorted(summary):
    lines.append(f"{kind:<20}{summary[kind]['count']:>7}{summary[kind]['bytes']:>15,}")
  return "\n".join(lines)
