"""The matmuls of a compiled module: each dot and convolution with its operands, FLOPs and
the [M, K] x [K, N] shape a matrix unit sees.

FLOPs are 2 x multiply-adds, counted as XLA's cost analysis counts them:

  dot          2 x (result elements) x (contracted elements)
  convolution  2 x batch x output features x input features per group x valid taps, where
               valid taps are the (output position, kernel position) pairs that read a
               real input element (not padding, not a dilation hole), added up over the
               output and multiplied over the spatial dims.

Counting over valid taps matters twice: a real 3x3 "SAME" convolution reads padding at its
edges, and the TPU compiler writes many dots as convolutions whose padded windows mostly
read padding (a [b, l, embed] x [embed, heads, kv] projection becomes a window of `heads`
taps of which one is real), so window size x features would overcount.

The MXU shape (M, K, N) of a convolution: M the lhs rows (batch and spatial positions), K
its input features times the window taps that split the contraction, N its output
features (`Matmul.mnk`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Iterator

from shardax.perf.hlo.module import Array, Instruction, Module

OPCODES = ("dot", "convolution")


def _ints(text: str) -> list[int]:
  return [int(d) for d in text.strip("{}").split(",") if d.strip()]


@dataclasses.dataclass(frozen=True)
class Window:
  """A convolution's `window=` attribute per spatial dim (XLA omits the defaults)."""
  size: tuple[int, ...]
  stride: tuple[int, ...]
  pad: tuple[tuple[int, int], ...]
  lhs_dilate: tuple[int, ...]
  rhs_dilate: tuple[int, ...]

  @classmethod
  def read(cls, text: str, n: int) -> "Window":
    fields = dict(f.split("=", 1) for f in text.strip("{}").split() if "=" in f)
    ints = lambda key: tuple(int(v) for v in fields[key].split("x")) if key in fields else (1,) * n
    pads = (tuple(tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x"))
            if "pad" in fields else ((0, 0),) * n)
    size = ints("size") if "size" in fields else (1,) * n
    return cls(size, ints("stride"), pads, ints("lhs_dilate"), ints("rhs_dilate"))

  def plain(self, d: int) -> bool:
    """Spatial dim `d` neither padded, strided nor dilated: its taps split the contraction."""
    return (self.pad[d], self.stride[d], self.lhs_dilate[d], self.rhs_dilate[d]) == ((0, 0), 1, 1, 1)


def _taps(size_in: int, size_out: int, k: int, stride: int, pad_low: int, ldil: int, rdil: int) -> int:
  """(output position, kernel position) pairs of one spatial dim that read a real input element."""
  last = (size_in - 1) * ldil
  return sum(1 for o in range(size_out) for j in range(k)
             if 0 <= (i := o * stride + j * rdil - pad_low) <= last and i % ldil == 0)


@dataclasses.dataclass(frozen=True)
class Matmul:
  instruction: Instruction
  lhs: Array
  rhs: Array
  result: Array
  flops: float
  mnk: tuple[int, int, int]     # the [M, K] x [K, N] a matrix unit sees; batch dims are repeats

  @property
  def dtype(self) -> str:
    """The lhs operand's element type (what the units run on)."""
    return self.lhs.dtype


def _dot(inst: Instruction, lhs: Array, rhs: Array, result: Array) -> tuple[float, tuple[int, int, int]]:
  lc, rc = _ints(inst.attr("lhs_contracting_dims")), _ints(inst.attr("rhs_contracting_dims"))
  lb, rb = _ints(inst.attr("lhs_batch_dims")), _ints(inst.attr("rhs_batch_dims"))
  k = math.prod(lhs.dims[d] for d in lc)
  m = math.prod(v for d, v in enumerate(lhs.dims) if d not in lc + lb)
  n = math.prod(v for d, v in enumerate(rhs.dims) if d not in rc + rb)
  return 2.0 * math.prod(result.dims) * k, (m, k, n)


def _convolution(inst: Instruction, lhs: Array, rhs: Array, result: Array) -> tuple[float, tuple[int, int, int]] | None:
  labels = inst.attr("dim_labels")
  if "_" not in labels or "->" not in labels:
    return None
  lhs_l, rest = labels.split("_", 1)
  rhs_l, out_l = rest.split("->", 1)
  spatial = sorted(c for c in lhs_l if c.isdigit())
  window = Window.read(inst.attr("window"), len(spatial))
  taps = 1
  for n, d in enumerate(spatial):
    taps *= _taps(lhs.dims[lhs_l.index(d)], result.dims[out_l.index(d)], window.size[n], window.stride[n],
                  window.pad[n][0], window.lhs_dilate[n], window.rhs_dilate[n])
  out = result.dims
  flops = 2.0 * out[out_l.index("b")] * out[out_l.index("f")] * rhs.dims[rhs_l.index("i")] * taps
  # A dot the compiler rewrote with a window: an unpadded window dim splits the contraction
  # (64 features x 2 taps for a 128-deep dot; the taps accumulate into the same outputs, so the
  # array sees i x taps), while a padded, strided or dilated one is a batch-like dim written as
  # a diagonal (attention's heads and kv groups: one real tap per output), which adds no depth.
  k = rhs.dims[rhs_l.index("i")]
  if inst.attr("window"):
    k *= math.prod(size for d, size in enumerate(window.size) if window.plain(d))
  m = math.prod(v for d, v in enumerate(lhs.dims) if lhs_l[d] != "f")   # batch and spatial positions
  return flops, (m, k, rhs.dims[rhs_l.index("o")])


def matmul(mod: Module, inst: Instruction) -> Matmul | None:
  """The Matmul of a dot or convolution instruction (None for anything else, or when its
  operands' shapes are not in `mod`)."""
  if inst.opcode not in OPCODES or not inst.results:
    return None
  operands = list(inst.inline_operand_arrays) or [
      mod.instructions[o].results[0] for o in inst.operands if o in mod.instructions and mod.instructions[o].results]
  if len(operands) < 2:
    return None
  lhs, rhs, result = operands[0], operands[1], inst.results[0]
  priced = (_dot if inst.opcode == "dot" else _convolution)(inst, lhs, rhs, result)
  return Matmul(inst, lhs, rhs, result, *priced) if priced else None


def matmuls(mod: Module, instructions: Iterable[Instruction] | None = None) -> Iterator[Matmul]:
  """The Matmul of each dot and convolution among `instructions` (default: the whole module)."""
  for inst in mod if instructions is None else instructions:
    if inst.opcode in OPCODES and (found := matmul(mod, inst)):
      yield found
