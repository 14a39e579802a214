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
from typing import Any, Iterable

import jax
import numpy as np

from shardax.perf import hlo
from shardax.perf.hlo import groups as replica_groups
from shardax.perf.hlo import megascale
from shardax.perf.hlo import sources as hlo_sources

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")



def _bytes(text: str) -> int:
  """Bytes of every array written in `text` (perf/hlo/dtypes.py: every XLA element type)."""
  return sum(a.nbytes for a in hlo.arrays(text))


def _executions(calls: dict[str, list[tuple[str, int]]], entry: str) -> dict[str, int]:
  """How often each computation runs per call of `entry` (loop bodies x trip count)."""
  runs: dict[str, int] = collections.defaultdict(int)

  def visit(comp: str, times: int, depth: int = 0) -> None:
    runs[comp] += times
    if depth < 64:
      for callee, factor in calls.get(comp, ()):
        visit(callee, times * factor, depth + 1)

  visit(entry, 1)
  return runs


@dataclasses.dataclass(frozen=True)
class Collective:
  name: str
  kind: str
  bytes: int          # per execution
  group_size: int
  op_name: str = ""
  source: str = ""
  executions: int = 1  # per call of the program: > 1 inside a loop (e.g. scanned layers)
  computation: str = ""  # the HLO computation holding it (a loop body, or the entry)
  is_async: bool = False  # a -start/-done pair the scheduler can overlap with compute
  replica_groups: str = ""  # the op's replica_groups attribute, as written
  link: str = ""      # "dcn": a TPU multi-slice host transfer (megascale send), priced on DCN
  span: int = 0       # for those: the slices in its group
  # Async ops: what the schedule runs between the -start and its -done in the same computation
  # (`_between`): compute ops (fusions, dots, convolutions, custom calls, loops) and the bodies
  # of the loops among them. No compute between them: nothing for the transfer to hide behind.
  compute_between: int = 0
  loops_between: tuple[str, ...] = ()
  concurrent_with: tuple[str, ...] = ()  # other async ops in flight at the same time (their names)


def trip_counts(hlo_text: str | hlo.Module) -> dict[str, int]:
  """Loop body -> how many times it runs per execution of its `while` (perf/hlo/loops.py)."""
  return hlo.trip_counts(hlo.parse(hlo_text) if isinstance(hlo_text, str) else hlo_text)


# The TPU compiler's asynchronous form on some generations (v5e in this libtpu; v4, v5p, v6e
# write -start/-done pairs or keep the op synchronous): an "async collective fusion" splits one
# collective into a start fusion (custom call AsyncCollectiveStart), slices fused into compute
# fusions, and a done fusion (AsyncCollectiveDone); each part repeats the collective op with
# the whole result shape, the same channel_id and an async_collective_fusion_config.
_ASYNC_FUSION = "async_collective_fusion_config"


def collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
  """Every collective op in compiled HLO text (`num_devices`: the module's partitions, read
  from its header when not given; only `replica_groups={}` needs it). The parts of one async
  collective fusion are one asynchronous collective."""
  mod = hlo.parse(hlo_text)
  if num_devices is None:
    num_devices = mod.num_partitions or 1
  receives: dict[str, str] = {}   # a megascale transfer's rendezvous -> its recv
  calls: dict[str, list[tuple[str, int | str]]] = collections.defaultdict(list)
  loop_trips = trip_counts(mod)
  parsed, entry = [], mod.entry
  between = _Between()
  for inst in mod:
    comp, name, op = inst.computation, inst.name, inst.opcode
    between.see(inst)
    loop = (inst.attr("body").lstrip("%"), inst.attr("condition").lstrip("%")) if op == "while" else ()
    trip = loop_trips.get(loop[0], 1) if loop else 1
    calls[comp].extend((callee, trip if callee in loop else 1) for callee in inst.called)
    kind = op.removesuffix("-start")
    if kind in COLLECTIVE_KINDS or kind == "ragged-all-to-all":
      parsed.append((inst, kind, op.endswith("-start")))
    elif op == "send" and (transfer := megascale.kind(inst)):
      parsed.append((inst, transfer, None))
    elif op == "recv" and (rz := megascale.rendezvous(inst)):
      receives[rz] = name
  sources = hlo_sources.Sources(mod)
  runs = _executions(calls, entry) if entry else {}
  found, fused_channels, one_to_one = [], set(), {}
  for inst, kind, is_start in parsed:
    name, comp = inst.name, inst.computation
    fused = _ASYNC_FUSION in inst.backend_config   # one part of the TPU compiler's async collective fusion
    if fused:
      channel = inst.attr("channel_id") or name
      if channel in fused_channels:      # its start, its slices inside a compute fusion, its done:
        continue                         # one transfer, counted once
      fused_channels.add(channel)
    if is_start is None:  # a megascale send: its tuple's first element is the buffer it sends
      target = megascale.target(inst)
      if kind == "collective-permute":
        # The runtime may split one permute into sends of the same buffer from disjoint source
        # slices (a cyclic shift over 4 slices: 1->2, 2->3, 3->4 and 4->1): each chip sends in
        # one of them, so together they are one transfer, counted once.
        part = (comp, inst.operands[0] if inst.operands else name)
        senders = megascale.senders(target)
        if part in one_to_one and senders and not senders & one_to_one[part]:
          one_to_one[part] |= senders
          continue
        one_to_one[part] = senders
      # What runs between the send and its done, and between the matching recv and its done
      # (where the receiver waits): the transfer hides behind matmul work in both, or not at all.
      ends = [name] + ([r] if (r := receives.get(megascale.rendezvous(inst))) else [])
      matmuls = min(between.matmuls.get(e, 0) for e in ends)
      found.append(_megascale(name, kind, _bytes(inst.shape.split("u32[]")[0]), target,
                              runs.get(comp, 1) if entry else 1, comp, sources(inst)[0],
                              compute_between=min(between.compute.get(e, 0) for e in ends) if matmuls else 0))
      continue
    ragged = kind == "ragged-all-to-all"
    if ragged:  # it sends its input rows (operand 0), not the receive buffer (operand 1)
      kind, is_start = "all-to-all", False
    if ragged and inst.operands:
      first = mod.instructions.get(inst.operands[0])
      operand_b = first.result_bytes if first else 0
    else:
      operand_b = (sum(a.nbytes for a in inst.inline_operand_arrays)
                   or sum(mod.instructions[o].result_bytes for o in inst.operands if o in mod.instructions))
    result_b = inst.result_bytes
    if is_start:  # async start returns (operands..., results..., context): keep the results
      result_b = max(result_b - operand_b, 0)
    nbytes = operand_b if kind == "reduce-scatter" or ragged else max(result_b, operand_b)
    if kind == "all-to-all" and is_start and not between.matmuls.get(name):
      is_start = False   # an async all-to-all with no matmul under it hides nothing
    op_name, source = sources(inst)
    groups = inst.replica_groups
    found.append(Collective(name, kind, nbytes, replica_groups.group_size(inst.line, num_devices, kind), op_name, source,
                            runs.get(comp, 1) if entry else 1, comp, is_start or bool(fused), groups,
                            compute_between=between.compute.get(name, 0),
                            loops_between=tuple(between.loops.get(name, ())),
                            concurrent_with=tuple(sorted(between.concurrent.get(name, ())))))
  return found


_COMPUTE_OPS = ("fusion", "convolution", "dot", "custom-call", "while", "call", "conditional")


class _Between:
  """For each async -start: the compute ops and loop bodies scheduled before its -done
  (a computation's instructions are printed in schedule order in compiled HLO)."""

  def __init__(self):
    self.open: dict[str, list[str]] = collections.defaultdict(list)  # computation -> open starts
    self.compute: dict[str, int] = collections.Counter()
    # Of those, the matmul work an async all-to-all can run under (the TPU compiler's dots are
    # convolutions or output fusions; grouped matmuls are Mosaic kernels).
    self.matmuls: dict[str, int] = collections.Counter()
    self.loops: dict[str, list[str]] = collections.defaultdict(list)
    self.concurrent: dict[str, set[str]] = collections.defaultdict(set)

  def see(self, inst: hlo.Instruction) -> None:
    comp, name, op = inst.computation, inst.name, inst.opcode
    if op.endswith("-done"):
      if inst.operands and inst.operands[0] in self.open[comp]:
        self.open[comp].remove(inst.operands[0])
    elif op in _COMPUTE_OPS:
      body = inst.attr("body").lstrip("%") if op == "while" else ""
      matmul = (op in ("convolution", "dot") or inst.attr("kind") == "kOutput"
                or inst.attr("custom_call_target") == '"tpu_custom_call"')
      for start in self.open[comp]:
        self.compute[start] += 1
        self.matmuls[start] += matmul
        if body:
          self.loops[start].append(body)
    if op.endswith("-start") or (op in ("send", "recv") and inst.attr("is_host_transfer") == "true"):
      for other in self.open[comp]:
        self.concurrent[other].add(name)
        self.concurrent[name].add(other)
      self.open[comp].append(name)


def _megascale(name: str, kind: str, sent: int, target: str, executions: int, comp: str,
               op_name: str, compute_between: int = 0) -> Collective:
  """A multi-slice TPU program's cross-slice transfer as a collective over its slices.

  The TPU compiler keeps every HLO collective inside a slice and moves the cross-slice part
  in host transfers (`send` with `_xla_megascale_transfer_type`) run by the megascale DCN
  runtime; `_xla_megascale_target="{1,2}x{0:3}"` names the slices (here 2) and the devices
  in each. `bytes` follows the collectives' convention (the full buffer): an all-gather
  sends 1/g of its result, the other kinds send the whole buffer (a one-to-one: its part).
  Asynchronous (`is_async`) when the schedule runs matmul work between its send and
  send-done and between its recv and recv-done (`compute_between`: the compute ops there).
  """
  span = megascale.span(target)
  nbytes = sent * span if kind == "all-gather" else sent
  return Collective(name, kind, nbytes, span, op_name, "", executions, comp, compute_between > 0, "",
                    "dcn", span, compute_between=compute_between)


def collective_summary(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {"count": n, "bytes": b}} per call of the program, loops unrolled."""
  summary: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for c in collectives(hlo_text):
    summary[c.kind]["count"] += c.executions
    summary[c.kind]["bytes"] += c.bytes * c.executions
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
  width = max(len(f"{v['bytes']:,}") for v in summary.values()) + 2
  lines = [f"{'collective':<20}{'count':>9}{'bytes':>{width}}"]
  for kind in sorted(summary):
    lines.append(f"{kind:<20}{summary[kind]['count']:>9,}{summary[kind]['bytes']:>{width},}")
  return "\n".join(lines)
