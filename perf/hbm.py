"""What of XLA's bytes accessed never crosses HBM: on-chip buffers, the second count of async
copies, and the in-flight buffers of async collective fusions.

XLA's cost analysis (costs.py) counts every operand an instruction reads and every result
it writes as memory traffic, wherever the buffer lives and whether or not the instruction
touches it. In HBM bytes, from the chip's side:

  an access to an S(1) buffer     none. The TPU compiler's memory-space assignment keeps
                                  some buffers in XLA's alternate memory space 1 (`S(1)` in
                                  a layout): on-chip SRAM, not HBM.
  an async copy of N bytes        N for each end in HBM: a prefetch (HBM -> S(1)) reads N,
                                  an eviction (S(1) -> HBM) writes N. XLA counts the pair
                                  as 4N (the start reads N and writes the (destination,
                                  source) pair, the done reads the pair and writes N).
  an async collective fusion      its source read once (the start's operands) and its
                                  result written once (the done's result). The TPU compiler
                                  splits an overlapped collective into a start fusion,
                                  compute fusions that carry the in-flight buffer in place
                                  (output_to_operand_aliasing) and a done fusion; XLA counts
                                  the whole buffer at the start, read and written again at
                                  every carrying fusion and read at the done (a Mixtral
                                  layer's three 940 MB expert weight gathers on v6e-256
                                  came to 40.6 GB of the layer's count, 12.0 GB with the
                                  same gathers synchronous).
  a fusion operand read through   the slices' bytes. XLA counts a fusion operand whole unless
  slices                          a slice reads it directly; where the fusion pads, reshapes
                                  or converts it first (the TPU compiler's windowed einsum
                                  picks each chunk of the layer input as the larger of two
                                  windows of a padded copy), it counts all of it, though the
                                  chip reads only the windows (a 128B layer on v5e-256: 671 MB
                                  counted a chunk, 168 MB read). The windows are counted whole,
                                  padding included: an upper bound.

`onchip_bytes` is the part of XLA's count that is not HBM traffic: for each instruction
run in sequence (not inside a fusion or a reduction, whose bytes XLA does not count),
XLA's own per-operand and per-output bytes (its cost analysis of that instruction alone)
of the operands and outputs above, and of a sliced operand what XLA counts beyond its
windows. The step model prices `Piece.hbm_bytes` (bytes
accessed less these) at the HBM bandwidth. Only TPU programs are read this way (tiled
layouts, `T(..)`): other backends use memory spaces for other things (a GPU's S(1) is
collective memory, still HBM).
"""

from __future__ import annotations

import functools
import math
from typing import Iterable

import jax

from shardax.perf import hlo

ON_CHIP = 1            # XLA's alternate memory space: TPU on-chip memory
HBM = (0, 2)           # default and pinned-default memory spaces
HOST = 5               # host memory (pinned_host): what an offload remat policy parks there
_SKIP = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")
# Ops that run other computations in sequence: their instructions are read one by one (loop
# bodies as pieces of their own), so the op itself adds nothing (alone, XLA would price its callees).
_SEQUENCES = ("while", "call", "conditional")
_ASYNC_FUSION = "async_collective_fusion_config"


def is_tpu(mod: hlo.Module) -> bool:
  """A TPU program: its layouts carry tiles (`T(8,128)`)."""
  return any(":T(" in i.shape for i in mod)


def _alone(mod: hlo.Module, inst: hlo.Instruction, then: hlo.Instruction | None = None) -> str:
  """`inst` (and `then`, its async done, as root) as a module of its own: its operands as
  parameters, its callees beside it."""
  params, seen = [], {}
  for name in inst.operands:
    if name not in seen:
      seen[name] = mod.instructions[name].shape
      params.append(f"  %{name} = {seen[name]} parameter({len(params)})")
  callees = mod.reachable(inst.called)
  blocks = ["\n".join(mod.computations[c].lines).replace("ENTRY ", "", 1)
            for c in mod.computations if c in callees]
  body = [inst.line.strip().removeprefix("ROOT ").strip()] + ([then.line.strip().removeprefix("ROOT ").strip()]
                                                              if then else [])
  signature = ", ".join(f"{name}: {shape}" for name, shape in seen.items())
  entry = (f"ENTRY %alone ({signature}) -> {(then or inst).shape} {{\n" + "\n".join(params) + "\n"
           + "\n".join(("  ROOT " if k == len(body) - 1 else "  ") + line for k, line in enumerate(body)) + "\n}")
  return hlo.logical_layouts("\n\n".join(["HloModule alone", mod.prefix, *blocks, entry]))


@functools.lru_cache(maxsize=64)   # texts carry the source tables: keep few
def _xla_bytes(text: str) -> dict[str, float]:
  from jax._src.lib import xla_client
  from jaxlib import _hlo
  try:
    client = jax.devices("cpu")[0].client
  except RuntimeError:
    client = jax.devices()[0].client
  cost = xla_client._xla.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(text))
  return {k: float(v) for k, v in cost.items() if k.startswith("bytes accessed")}


def _chain_role(mod: hlo.Module, inst: hlo.Instruction) -> str:
  """'start', 'done' or 'carry' for a fusion of the TPU compiler's async collective fusion (a
  start fusion, compute fusions that carry the in-flight buffer in place, a done fusion; each
  repeats the collective with an `async_collective_fusion_config`: sharding/report.py), else ''."""
  if inst.opcode != "fusion":
    return ""
  inner = [i for c in mod.reachable(inst.called) for i in mod.computations[c].instructions]
  if not any(_ASYNC_FUSION in i.attr("backend_config") for i in inner):
    return ""
  targets = " ".join(i.attr("custom_call_target") for i in inner if i.opcode == "custom-call")
  return "start" if "AsyncCollectiveStart" in targets else "done" if "AsyncCollectiveDone" in targets else "carry"


def _instruction_onchip(mod: hlo.Module, inst: hlo.Instruction) -> float:
  """Bytes XLA counts for `inst` that do not cross HBM (module docstring); an async copy is
  priced at its start, with its done."""
  if (inst.opcode in _SKIP or inst.opcode in _SEQUENCES or inst.opcode.startswith("async-")
      or inst.opcode == "copy-done" or any(o not in mod.instructions for o in inst.operands)):
    return 0.0
  operand_spaces = [hlo.memory_spaces(mod.instructions[o].shape) for o in inst.operands]
  result_spaces = hlo.memory_spaces(inst.shape)
  if inst.opcode == "copy-start":   # result (destination, source, context); the done writes the destination
    done = mod.instructions.get(mod.async_done.get(inst.name, ""))
    if done is None or not result_spaces:
      return 0.0
    moved = inst.results[0].nbytes
    ends = (operand_spaces[0][:1] or [0]) + result_spaces[:1]   # source read, destination written
    try:
      counted = _xla_bytes(_alone(mod, inst, done)).get("bytes accessed", 0.0)
    except Exception:   # not parsable alone: XLA's count of a copy pair, 4N
      counted = 4.0 * moved
    return max(0.0, counted - moved * sum(e in HBM for e in ends))
  role = _chain_role(mod, inst)
  sliced = _sliced_reads(mod, inst)
  operands = {k for k, s in enumerate(operand_spaces) if s and all(x == ON_CHIP for x in s)}
  outputs = {j for j, s in enumerate(result_spaces) if s == ON_CHIP}
  if role == "start":     # allocates the destination; the collective writes it once, at the done
    outputs |= set(range(len(result_spaces)))
  elif role == "done":    # waits: the landed result is its one write, the in-flight buffer no read
    operands |= set(range(len(inst.operands)))
  elif role == "carry":   # the in-flight buffers pass through in place
    alias_in, alias_out = inst.aliasing
    operands, outputs = operands | alias_in, outputs | alias_out
  if not operands and not outputs and not sliced:
    return 0.0
  try:
    counted = _xla_bytes(_alone(mod, inst))
  except Exception:   # not parsable alone: every byte of those operands and results
    counted = {f"bytes accessed{k}{{}}": float(mod.instructions[o].result_bytes) for k, o in enumerate(inst.operands)}
    counted.update({f"bytes accessedout{{{j}}}": float(a.nbytes) for j, a in enumerate(inst.results)})
    counted["bytes accessedout{}"] = float(inst.result_bytes)
  out = sum(counted.get(f"bytes accessed{k}{{}}", 0.0) for k in operands)
  out += sum(max(0.0, counted.get(f"bytes accessed{k}{{}}", 0.0) - read) for k, read in sliced.items()
             if k not in operands)
  if not inst.is_tuple:
    return out + (counted.get("bytes accessedout{}", 0.0) if outputs else 0.0)
  return out + sum(counted.get(f"bytes accessedout{{{j}}}", 0.0) for j in outputs)


# Ops a fusion computes element by element from an index into their operand: a slice of their
# result reads only the operand elements it maps to.
_INDEXING = ("bitcast", "reshape", "transpose", "copy", "pad", "convert")
_SLICES = ("dynamic-slice", "slice")


def _elements_read(mod: hlo.Module, name: str) -> int | None:
  """Elements of value `name` (a parameter of a fused computation, or an indexing op's
  result on it) that the computation reads, when every use of it ends in slices: the slices'
  element counts; None when some use reads it whole (an arithmetic op, the root, a slice's index)."""
  inst = mod.instructions[name]
  if inst.root:
    return None
  total = 0
  for user in mod.users.get(name, ()):
    if user.opcode in _SLICES and user.operands[:1] == (name,) and name not in user.operands[1:]:
      total += math.prod(user.results[0].dims) if user.results else 0
    elif user.opcode in _INDEXING and user.operands[:1] == (name,) and name not in user.operands[1:]:
      n = _elements_read(mod, user.name)
      if n is None:
        return None
      total += n
    elif user.opcode == "fusion" and user.called:   # a nested fusion: follow its parameters
      params = {int(i.operand_text): i.name for i in mod.computations[user.called[0]].instructions
                if i.opcode == "parameter"}
      for k in (k for k, o in enumerate(user.operands) if o == name):
        n = _elements_read(mod, params[k])
        if n is None:
          return None
        total += n
    else:
      return None
  return total


def _sliced_reads(mod: hlo.Module, inst: hlo.Instruction) -> dict[int, float]:
  """{operand index: bytes read} of a fusion's operands that it reads only through slices
  (module docstring), where that is less than the whole operand."""
  if inst.opcode != "fusion" or not inst.called or inst.called[0] not in mod.computations:
    return {}
  comp = mod.computations[inst.called[0]]
  params = {int(i.operand_text): i for i in comp.instructions if i.opcode == "parameter"}
  out = {}
  for k, param in params.items():
    if len(param.results) != 1 or k >= len(inst.operands):
      continue
    n = _elements_read(mod, param.name)
    whole = param.results[0]
    if n is not None and n < math.prod(whole.dims):
      out[k] = float(whole.nbytes) * n / math.prod(whole.dims)
  return out


def onchip_bytes(mod: hlo.Module, computations: Iterable[str]) -> float:
  """What XLA's cost analysis counts as bytes accessed in `computations` (a piece: the entry
  or a loop body and what it calls) that never crosses HBM; 0 for a program not for a TPU."""
  if not is_tpu(mod):
    return 0.0
  inner = mod.fused
  return sum(_instruction_onchip(mod, i) for c in computations if c not in inner and c in mod.computations
             for i in mod.computations[c].instructions)


# Ops that move data between device and host memory when one end is a host (S(5)) buffer.
_HOST_MOVES = {"dynamic-update-slice-start": True, "dynamic-slice-start": True, "copy-start": True,
               "dynamic-update-slice": False, "dynamic-slice": False, "copy": False}


def _host_move(mod: hlo.Module, inst: hlo.Instruction) -> float:
  """Bytes `inst` moves across the host link: the update a dynamic-update-slice writes into a
  host buffer, the slice a dynamic-slice reads out of one, a copy between host and device;
  0 for anything else."""
  if inst.opcode not in _HOST_MOVES or any(o not in mod.instructions for o in inst.operands[:2]):
    return 0.0
  operands = [mod.instructions[o] for o in inst.operands]
  if not operands or HOST not in hlo.memory_spaces(operands[0].shape) + (
      hlo.memory_spaces(inst.shape)[:1] if inst.opcode.startswith("copy") else []):
    return 0.0
  if inst.opcode.startswith("dynamic-update-slice"):
    return float(operands[1].result_bytes) if len(operands) > 1 else 0.0
  if inst.opcode.endswith("-start"):   # the landed slice or copy is the done's result
    done = mod.instructions.get(mod.async_done.get(inst.name, ""))
    return float(done.result_bytes) if done is not None else 0.0
  return float(inst.result_bytes)


def host_bytes(mod: hlo.Module, computations: Iterable[str]) -> tuple[float, float]:
  """(asynchronous, synchronous) bytes the instructions of `computations` (a piece) move between
  device and host memory: an offload remat policy's layer inputs and projections written to
  host buffers in the forward pass and read back in the backward pass. Their time is on the
  chip's host link (hardware.Chip.host_bandwidth), not on HBM's; the `-start`/`-done` forms run
  beside the piece's compute (perf/stepmodel.py)."""
  inner = mod.fused
  moved = [0.0, 0.0]
  for c in computations:
    for inst in mod.computations[c].instructions if c in mod.computations and c not in inner else ():
      if n := _host_move(mod, inst):
        moved[0 if _HOST_MOVES[inst.opcode] else 1] += n
  return moved[0], moved[1]


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def stacked_share(mod: hlo.Module, computations: Iterable[str], depth: int) -> tuple[float, float]:
  """(of the HBM traffic, of the collective bytes) of the instructions run in `computations`,
  the share in instructions that read or write an array led by `depth` (ndim > 1): a scanned
  stack's [L, ...] weights, gradients and optimizer moments outside its loops. What depends on
  the depth there, as opposed to the embedding, head and loss and a layer the compiler peeled
  out of its loop (perf/costs.py `deepen`). Traffic: operand and result leaves not in on-chip or
  host memory, logical bytes; collectives: each one's larger end."""
  inner = mod.fused
  leaves = lambda shape: [a for a, s in zip(hlo.arrays(shape), hlo.memory_spaces(shape)) if s in HBM]
  stack, total = [0, 0], [0, 0]
  for c in computations:
    for inst in mod.computations[c].instructions if c in mod.computations and c not in inner else ():
      if inst.opcode in _SKIP or inst.opcode in _SEQUENCES:
        continue
      ins = [a for o in inst.operands if o in mod.instructions for a in leaves(mod.instructions[o].shape)]
      arrays = ins + leaves(inst.shape)
      on_stack = any(len(a.dims) > 1 and a.dims[0] == depth for a in arrays)
      n = sum(a.nbytes for a in arrays)
      total[0] += n
      stack[0] += n * on_stack
      if inst.opcode.removesuffix("-start") in _COLLECTIVES:
        moved = max(sum(a.nbytes for a in ins), inst.result_bytes - (sum(a.nbytes for a in ins)
                                                                     if inst.opcode.endswith("-start") else 0))
        total[1] += moved
        stack[1] += moved * on_stack
  return tuple(s / t if t else 0.0 for s, t in zip(stack, total))
