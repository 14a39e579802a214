"""Which of a piece's memory traffic sits in kernels with no matmul in them.

A GPU runs an XLA program one kernel after another on its compute stream: each fusion is a
kernel, and a kernel's HBM traffic overlaps only its own arithmetic. A matmul kernel streams
its operands under its math; an elementwise or reduction kernel (a norm, an activation, a
residual add, the optimizer update, a layout copy) has no math to hide under, so its traffic
is time of its own, added to the step. A TPU differs: its compiler's memory-space assignment
prefetches the next fusions' operands into on-chip memory with async copies while the current
fusion runs, so one fusion's HBM traffic can run under another's matmuls (the step model keeps
a piece's max(compute, memory) there; perf/stepmodel.py assumption 2).

`matmul_free_share` reads a piece's instructions run in sequence (the entry or a loop body and
the plain calls it makes; not fused computations, whose bytes their fusion carries) and splits
their operand and result bytes (HBM leaves, logical sizes) into those of instructions that run a
matmul (a dot or convolution anywhere inside, or a library call: cuBLAS, cuDNN, a Pallas kernel)
and the rest. The share of the rest, applied to XLA's bytes accessed of the piece (costs.py),
is the traffic a GPU pays on its own. Shapes over-count an in-place update (a
dynamic-update-slice reads and writes its whole buffer by shape, a slice of it in fact), in
both groups alike: only the share is taken from them, XLA's total stays the total.
"""

from __future__ import annotations

from typing import Iterable

from shardax.perf import hbm, hlo

_MATMULS = ("dot", "convolution", "custom-call")
_NOT_KERNELS = hbm._SKIP + hbm._SEQUENCES + hbm._COLLECTIVES


def _runs_matmul(mod: hlo.Module, inst: hlo.Instruction) -> bool:
  if inst.opcode in _MATMULS:
    return True
  return any(i.opcode in _MATMULS for c in mod.reachable(inst.called) for i in mod.computations[c].instructions)


def matmul_free_share(mod: hlo.Module, computations: Iterable[str]) -> float:
  """Of the bytes the kernels run in `computations` (a piece: see the module docstring) read and
  write, the share in kernels that run no matmul; 0 when they move nothing."""
  leaves = lambda shape: sum(a.nbytes for a, s in zip(hlo.arrays(shape), hlo.memory_spaces(shape)) if s in hbm.HBM)
  free = total = 0
  for c in computations:
    for inst in mod.computations[c].instructions if c in mod.computations and c not in mod.fused else ():
      op = inst.opcode
      if op in _NOT_KERNELS or op.endswith(("-start", "-done")) or op in ("send", "recv"):
        continue   # no kernel of its own, or a transfer (priced as a collective)
      n = leaves(inst.shape) + sum(leaves(mod.instructions[o].shape) for o in inst.operands if o in mod.instructions)
      total += n
      free += 0 if _runs_matmul(mod, inst) else n
  return free / total if total else 0.0
