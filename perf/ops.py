"""Ops priced by what they are: one function from an op (kind, operand dtype, FLOPs) to seconds.

XLA's cost analysis prices what XLA itself compiles (fusions, dots, convolutions) and
counts nothing for a custom call: on a GPU the matmuls run as cuBLAS GEMMs
(`__cublas$gemm`, `__cublas$lt$matmul`) and attention as cuDNN's fused flash kernel
(`__cudnn$fmha...`), so a GPU program's matmuls would read as free. `custom_call_ops`
reads those calls from the compiled HLO and gives each its FLOPs from its operands:

  GEMM              2 x (result elements) x (contracted elements), from the shapes and
                    the call's dot_dimension_numbers;
  flash attention   forward 2 matmuls of B x H x Sq x Sk x D (QK^T, PV): 4 B H Sq Sk D,
                    halved for a causal mask (the convention of the model FLOPs,
                    perf/flops.py); backward 2.5 x that (it recomputes the scores
                    and runs dV, dP, dQ, dK: 5 matmuls to the forward's 2).

`seconds` prices every op the step model sees through the same rate table: peak of the
operand dtype (perf/hardware.py; bf16 for 16- and 32-bit floats, whose XLA default precision runs
on the bf16 units; `peak_int8_flops` for s8/u8 operands, `peak_fp8_flops` for the float8
types, each falling back to bf16 on a chip without such units) times the efficiency of
the op's kind on that chip family.

XLA's own dots with 8-bit operands (model.quantization, layers/quantization.py) are
counted by XLA's cost analysis like any dot, at 2 FLOPs per multiply-add; `eight_bit_dots`
finds them (dots, and the convolutions the TPU compiler writes dots as; their FLOPs by the
one rule of perf/hlo/matmuls.py) so the step model can move their FLOPs from the bf16 rate
to their own (costs.py). All of these read the records of perf/hlo (the module parsed once).

Efficiencies, each with where it comes from:
  TPU "xla"        0.8: large XLA-fused bf16 matmuls (docs/scale.md, set before the
                   published TPU rows were compared; read off no row).
  GPU "gemm"       0.73, H100 SXM: lm.1b on one H100 (docs/performance.md, "On one H100
                   GPU"): cuBLAS + Triton gemm kernels took 65.3% of a
                   0.5175 s step for 6 x 1.234e9 params x 32768 tokens = 2.43e14 FLOPs:
                   2.43e14 / (0.653 x 0.5175 s x 989e12) = 0.73.
  GPU "xla"        0.73: XLA's own gemm fusions (Triton) are in the same measured 65.3%.
  GPU "attention"  0.28, H100 SXM: the same profile, cuDNN flash attention forward +
                   backward 16.4% of the step; lm.1b's causal attention (24 layers, S 2048,
                   d 2048, batch 16) is 3.5 x 6.6e12 = 2.31e13 FLOPs as priced here:
                   2.31e13 / (0.164 x 0.5175 s x 989e12) = 0.28.
"""

from __future__ import annotations

import math
from typing import Iterable

from shardax.perf.hardware import MATMUL_EFFICIENCY, Chip
from shardax.perf import hlo
from shardax.perf.hlo import dtypes, matmuls

EFFICIENCY = {
    ("tpu", "xla"): MATMUL_EFFICIENCY["tpu"], ("tpu", "gemm"): MATMUL_EFFICIENCY["tpu"],
    ("tpu", "attention"): MATMUL_EFFICIENCY["tpu"],
    ("gpu", "xla"): MATMUL_EFFICIENCY["gpu"], ("gpu", "gemm"): MATMUL_EFFICIENCY["gpu"],
    ("gpu", "attention"): 0.28,
}
_GEMM, _LT_MATMUL = "__cublas$gemm", "__cublas$lt$matmul"
_FMHA = "__cudnn$fmha"


def family(chip: Chip) -> str:
  return "gpu" if chip.torus_dims == 0 else "tpu"


def efficiency(chip: Chip, kind: str) -> float:
  """Share of the dtype's peak that an op of `kind` reaches on this chip family."""
  return EFFICIENCY.get((family(chip), kind), chip.matmul_efficiency)


def units(dtype: str) -> str:
  """Which units run operands of `dtype` (HLO spelling): "int8", "fp8", else the dtype itself."""
  return "int8" if dtype in dtypes.INT8 else "fp8" if dtype in dtypes.FLOAT8 else dtype


def peak(chip: Chip, dtype: str) -> float:
  """FLOP/s of the chip's units for operands of `dtype` (HLO spelling: bf16, s8, f8e4m3fn)."""
  return getattr(chip, f"peak_{units(dtype)}_flops", 0.0) or chip.peak_bf16_flops


def seconds(kind: str, dtype: str, flops: float, chip: Chip) -> float:
  """Time of `flops` of an op of `kind` ("xla", "gemm", "attention") on `dtype` operands."""
  return flops / (peak(chip, dtype) * efficiency(chip, kind)) if flops else 0.0


def _operands(mod: hlo.Module, inst: hlo.Instruction) -> list[hlo.Array]:
  """Each operand's array: written inline, else the first array its definition gives it."""
  return list(inst.inline_operand_arrays) or [
      mod.instructions[o].results[0] for o in inst.operands if o in mod.instructions and mod.instructions[o].results]


def _dims(config: dict, key: str) -> list[int]:
  return [int(d) for d in config.get(key, [])]


def gemm_flops(mod: hlo.Module, inst: hlo.Instruction) -> tuple[str, float]:
  """(operand dtype, FLOPs) of a cuBLAS GEMM custom call."""
  result, operands = inst.results[0], _operands(mod, inst)
  dnums = inst.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
  contracting = _dims(dnums, "lhs_contracting_dimensions") or [len(operands[0].dims) - 1]
  k = math.prod(operands[0].dims[d] for d in contracting)
  return operands[0].dtype, 2.0 * math.prod(result.dims) * k


def attention_flops(mod: hlo.Module, inst: hlo.Instruction, variant: str) -> tuple[str, float]:
  """(operand dtype, FLOPs) of a cuDNN flash-attention custom call (forward or backward)."""
  operands = list(hlo.arrays(inst.attr("operand_layout_constraints"))) or _operands(mod, inst)
  dtype, q, k = operands[0].dtype, operands[0].dims, operands[1].dims
  config = inst.backend_config.get("cudnn_fmha_backend_config", {})
  bmm1 = config.get("bmm1_dot_dimension_numbers") or config.get("bmm1_grad_gemm1_dot_dimension_numbers") or {}
  batch = _dims(bmm1, "lhs_batch_dimensions") or [0, 2]   # [B, S, H, D] by default
  head = _dims(bmm1, "lhs_contracting_dimensions") or [len(q) - 1]
  k_batch = _dims(bmm1, "rhs_batch_dimensions") or batch
  k_head = _dims(bmm1, "rhs_contracting_dimensions") or head
  b = math.prod(q[d] for d in batch)
  d = math.prod(q[i] for i in head)
  sq = math.prod(q[i] for i in range(len(q)) if i not in batch + head)
  sk = math.prod(k[i] for i in range(len(k)) if i not in k_batch + k_head)
  flops = 4.0 * b * sq * sk * d
  if "CAUSAL" in str(config.get("mask_type", "")).upper():
    flops /= 2
  if "backward" in variant.lower():
    flops *= 2.5
  return dtype, flops


def _grouped(inst: hlo.Instruction) -> bool:
  """The TPU compiler's grouped matmul (jax.lax.ragged_dot): a Mosaic kernel, `tpu_custom_call`
  named ragged-dot-*, tagged ragged_dot_tiling; megablox's gmm/tgmm kernels likewise."""
  op_name = inst.metadata.get("op_name", "")
  return (inst.attr("custom_call_target") == '"tpu_custom_call"'
          and ("ragged_dot_tiling=" in inst.attr("backend_config") or "ragged-dot-" in op_name or "gmm" in op_name))


def custom_call_ops(mod: hlo.Module, instructions: Iterable[hlo.Instruction] | None = None
                    ) -> list[tuple[str, str, float]]:
  """(kind, operand dtype, FLOPs) of each library call XLA's cost analysis does not count, among
  `instructions` (default: the whole module)."""
  out = []
  for inst in mod if instructions is None else instructions:
    if inst.opcode != "custom-call":
      continue
    target = inst.attr("custom_call_target").strip('"')
    if target == _GEMM or target.startswith(_LT_MATMUL):
      out.append(("gemm", *gemm_flops(mod, inst)))
    elif target.startswith(_FMHA):
      out.append(("attention", *attention_flops(mod, inst, target[len(_FMHA):])))
    elif _grouped(inst) and (flops := grouped_matmul_flops(mod, inst)):
      out.append(("gemm", *flops))
  return out


def grouped_matmul_flops(mod: hlo.Module, inst: hlo.Instruction) -> tuple[str, float] | None:
  """(operand dtype, FLOPs) of a TPU grouped-matmul kernel (ragged_dot's forward and its
  input gradient), which XLA's cost analysis prices at 0: the kernel's own declared cost
  (`cost_estimate.flops`, 2 x rows x K x N over the whole row buffer). Its grid is dynamic
  (it visits the row tiles that hold a group's rows), so this is what it runs when every
  row of the buffer is filled: the upper bound, and what a full receive buffer costs."""
  flops = float(inst.backend_config.get("custom_call_config", {}).get("cost_estimate", {}).get("flops", 0) or 0)
  if not flops:
    return None
  operands = list(hlo.arrays(inst.attr("operand_layout_constraints"))) or _operands(mod, inst)
  floats = [a.dtype for a in operands if a.dtype not in ("s32", "u32", "s64", "pred")]
  return (floats[0] if floats else "bf16"), flops


def eight_bit_dots(mod: hlo.Module, instructions: Iterable[hlo.Instruction] | None = None
                   ) -> list[tuple[str, str, float]]:
  """("xla", operand dtype, FLOPs) of each dot or convolution among `instructions` (default:
  the whole module) whose lhs is an 8-bit type."""
  return [("xla", m.dtype, m.flops) for m in matmuls.matmuls(mod, instructions)
          if m.dtype in dtypes.INT8 or m.dtype in dtypes.FLOAT8]
