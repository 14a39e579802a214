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
operand dtype (chips.py; bf16 for 16- and 32-bit floats, whose XLA default precision runs
on the bf16 units; `peak_int8_flops` for s8/u8 operands, `peak_fp8_flops` for the float8
types, each falling back to bf16 on a chip without such units) times the efficiency of
the op's kind on that chip family.

XLA's own dots with 8-bit operands (model.quantization, layers/quantization.py) are
counted by XLA's cost analysis like any dot, at 2 FLOPs per multiply-add; `eight_bit_dots`
finds them (dots, and the convolutions the TPU compiler writes dots as) so the step
model can move their FLOPs from the bf16 rate to their own (costs.py).

Efficiencies, each with where it comes from:
  TPU "xla"        0.8: large XLA-fused bf16 matmuls (docs/scale.md, set before the
                   published TPU rows were compared; read off no row).
  GPU "gemm"       0.73, H100 SXM: lm.1b on one H100 (docs/performance.md, "On one H100
                   GPU", 2026-11-23): cuBLAS + Triton gemm kernels took 65.3% of a
                   0.5175 s step for 6 x 1.234e9 params x 32768 tokens = 2.43e14 FLOPs:
                   2.43e14 / (0.653 x 0.5175 s x 989e12) = 0.73.
  GPU "xla"        0.73: XLA's own gemm fusions (Triton) are in the same measured 65.3%.
  GPU "attention"  0.28, H100 SXM: the same profile, cuDNN flash attention forward +
                   backward 16.4% of the step; lm.1b's causal attention (24 layers, S 2048,
                   d 2048, batch 16) is 3.5 x 6.6e12 = 2.31e13 FLOPs as priced here:
                   2.31e13 / (0.164 x 0.5175 s x 989e12) = 0.28.
"""

from __future__ import annotations

import json
import math
import re

from shardax.perf.hardware import MATMUL_EFFICIENCY, Chip
from shardax.perf import hlo

EFFICIENCY = {
    ("tpu", "xla"): MATMUL_EFFICIENCY["tpu"], ("tpu", "gemm"): MATMUL_EFFICIENCY["tpu"],
    ("tpu", "attention"): MATMUL_EFFICIENCY["tpu"],
    ("gpu", "xla"): MATMUL_EFFICIENCY["gpu"], ("gpu", "gemm"): MATMUL_EFFICIENCY["gpu"],
    ("gpu", "attention"): 0.28,
}
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul[\w$]*)"')
_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_CONFIG = re.compile(r"backend_config=(\{.*\})\s*$")
# The TPU compiler's grouped matmul (jax.lax.ragged_dot): a Mosaic kernel, `tpu_custom_call`
# named ragged-dot-*, tagged ragged_dot_tiling; megablox's gmm/tgmm kernels likewise.
_GROUPED = re.compile(r'custom_call_target="tpu_custom_call".*(?:ragged_dot_tiling=|op_name="[^"]*(?:ragged-dot-|gmm))')


def family(chip: Chip) -> str:
  return "gpu" if chip.torus_dims == 0 else "tpu"


def efficiency(chip: Chip, kind: str) -> float:
  """Share of the dtype's peak that an op of `kind` reaches on this chip family."""
  return EFFICIENCY.get((family(chip), kind), chip.matmul_efficiency)


EIGHT_BIT = {"s8": "int8", "u8": "int8", "f8e4m3fn": "fp8", "f8e5m2": "fp8", "f8e4m3fnuz": "fp8",
             "f8e5m2fnuz": "fp8", "f8e4m3b11fnuz": "fp8", "f8e4m3": "fp8"}


def peak(chip: Chip, dtype: str) -> float:
  """FLOP/s of the chip's units for operands of `dtype` (HLO spelling: bf16, s8, f8e4m3fn)."""
  return getattr(chip, f"peak_{EIGHT_BIT.get(dtype, dtype)}_flops", 0.0) or chip.peak_bf16_flops


def seconds(kind: str, dtype: str, flops: float, chip: Chip) -> float:
  """Time of `flops` of an op of `kind` ("xla", "gemm", "attention") on `dtype` operands."""
  return flops / (peak(chip, dtype) * efficiency(chip, kind)) if flops else 0.0


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array written in `text` (any XLA element type: perf/hlo/dtypes.py)."""
  return [(a.dtype, a.dims) for a in hlo.arrays(text)]


def _dims(config: dict, key: str, name: str) -> list[int]:
  return [int(d) for d in config.get(key, {}).get(name, [])]


def _config(line: str, key: str) -> dict:
  m = _CONFIG.search(line)
  if not m:
    return {}
  try:
    return json.loads(m.group(1)).get(key, {})
  except ValueError:
    return {}


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s[a-z][\w\-]*\(")


def result_shapes(lines) -> dict[str, str]:
  """Instruction name -> the text of its result shape (compiled HLO names operands without shapes)."""
  return {m.group(1): m.group(2) for line in lines if (m := _DEF.match(line))}


def _operand_shapes(line: str, shapes: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
  """Each operand's (dtype, dims): written inline, else the shape its definition gives it."""
  inside = line.partition(" custom-call(")[2].split(")", 1)[0]
  if inline := _shapes(inside):
    return inline
  names = [o.strip().lstrip("%") for o in inside.split(",") if o.strip()]
  return [found[0] for n in names if (found := _shapes(shapes.get(n, "")))]


def gemm_flops(line: str, shapes: dict[str, str] | None = None) -> tuple[str, float]:
  """(operand dtype, FLOPs) of a cuBLAS GEMM custom call's HLO line."""
  result_text = line.partition(" custom-call(")[0]
  result = _shapes(result_text.split("=", 1)[1])[0]
  operands = _operand_shapes(line, shapes or {})
  dnums = _config(line, "gemm_backend_config").get("dot_dimension_numbers", {})
  contracting = [int(d) for d in dnums.get("lhs_contracting_dimensions", [])] or [len(operands[0][1]) - 1]
  k = math.prod(operands[0][1][d] for d in contracting)
  return operands[0][0], 2.0 * math.prod(result[1]) * k


def attention_flops(line: str, variant: str, shapes: dict[str, str] | None = None) -> tuple[str, float]:
  """(operand dtype, FLOPs) of a cuDNN flash-attention custom call (forward or backward)."""
  constraints = re.search(r"operand_layout_constraints=\{(.*?)\}\s*,\s*[a-z_]+=", line)
  operands = _shapes(constraints.group(1)) if constraints else _operand_shapes(line, shapes or {})
  (dtype, q), (_, k) = operands[0], operands[1]
  config = _config(line, "cudnn_fmha_backend_config")
  bmm1 = config.get("bmm1_dot_dimension_numbers") or config.get("bmm1_grad_gemm1_dot_dimension_numbers") or {}
  batch = [int(d) for d in bmm1.get("lhs_batch_dimensions", [])] or [0, 2]   # [B, S, H, D] by default
  head = [int(d) for d in bmm1.get("lhs_contracting_dimensions", [])] or [len(q) - 1]
  k_batch = [int(d) for d in bmm1.get("rhs_batch_dimensions", [])] or batch
  k_head = [int(d) for d in bmm1.get("rhs_contracting_dimensions", [])] or head
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


def custom_call_ops(lines, shapes: dict[str, str] | None = None) -> list[tuple[str, str, float]]:
  """(kind, operand dtype, FLOPs) of each library call XLA's cost analysis does not count;
  `shapes`: result shapes by name (`result_shapes` of the whole module)."""
  out = []
  for line in lines:
    if " custom-call(" not in line:
      continue
    if _GEMM.search(line):
      out.append(("gemm", *gemm_flops(line, shapes)))
    elif f := _FMHA.search(line):
      out.append(("attention", *attention_flops(line, f.group(1), shapes)))
    elif _GROUPED.search(line) and (flops := grouped_matmul_flops(line)):
      out.append(("gemm", *flops))
  return out


def grouped_matmul_flops(line: str) -> tuple[str, float] | None:
  """(operand dtype, FLOPs) of a TPU grouped-matmul kernel (ragged_dot's forward and its
  input gradient), which XLA's cost analysis prices at 0: the kernel's own declared cost
  (`cost_estimate.flops`, 2 x rows x K x N over the whole row buffer). Its grid is dynamic
  (it visits the row tiles that hold a group's rows), so this is what it runs when every
  row of the buffer is filled: the upper bound, and what a full receive buffer costs."""
  flops = float(_config(line, "custom_call_config").get("cost_estimate", {}).get("flops", 0) or 0)
  if not flops:
    return None
  inside = re.search(r"operand_layout_constraints=\{(.*?)\}\s*,\s*[a-z_]+=", line)
  floats = [t for t, _ in _shapes(inside.group(1) if inside else line.split("custom-call(", 1)[1])
            if t not in ("s32", "u32", "s64", "pred")]
  return (floats[0] if floats else "bf16"), flops


_DOT = re.compile(r"\s(dot|convolution)\(([^)]*)\)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _window(text: str, n: int) -> dict[str, list]:
  """A convolution's window attribute: size, stride, pad (low, high), lhs/rhs dilation per
  spatial dim (XLA omits the defaults)."""
  fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
  ints = lambda key, default: [int(v) for v in fields[key].split("x")] if key in fields else [default] * n
  pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
  return {"size": ints("size", 1), "stride": ints("stride", 1), "pad": pads,
          "lhs": ints("lhs_dilate", 1), "rhs": ints("rhs_dilate", 1)}


def _taps(size_in: int, size_out: int, k: int, stride: int, pad_low: int, ldil: int, rdil: int) -> int:
  """(output position, kernel position) pairs of one spatial dim that read a real input
  element (not padding, not a dilation hole): what each output sums over, added up."""
  last = (size_in - 1) * ldil
  return sum(1 for o in range(size_out) for j in range(k)
             if 0 <= (i := o * stride + j * rdil - pad_low) <= last and i % ldil == 0)


def _conv_flops(line: str, lhs: tuple, rhs: tuple, out: tuple) -> float:
  """2 x multiply-adds of a convolution, counted as XLA's cost analysis counts them: over
  valid kernel taps only. The TPU compiler writes many dots as convolutions whose padded
  windows mostly read padding (a [b, l, embed] x [embed, heads, kv] projection becomes a
  window of `heads` taps of which one is real), so window size x features would overcount."""
  labels = _LABELS.search(line)
  if not labels:
    return 0.0
  lhs_l, rhs_l, out_l = labels.groups()
  spatial = sorted(c for c in lhs_l if c.isdigit())
  found = _WINDOW.search(line)
  window = _window(found.group(1) if found else "", len(spatial))
  taps = 1
  for n, d in enumerate(spatial):
    taps *= _taps(lhs[lhs_l.index(d)], out[out_l.index(d)], window["size"][n], window["stride"][n],
                  window["pad"][n][0], window["lhs"][n], window["rhs"][n])
  batch = out[out_l.index("b")]
  return 2.0 * batch * out[out_l.index("f")] * rhs[rhs_l.index("i")] * taps


def eight_bit_dots(lines, shapes: dict[str, str] | None = None) -> list[tuple[str, str, float]]:
  """("xla", operand dtype, FLOPs) of each dot or convolution whose lhs is an 8-bit type.
  `shapes`: result shapes by name (`result_shapes`, parameters included)."""
  out = []
  for line in lines:
    m = _DOT.search(line)
    if not m or "=" not in line:
      continue
    names = [o.strip().lstrip("%") for o in m.group(2).split(",")]
    operands = _shapes(m.group(2)) or [found[0] for n in names if (found := _shapes((shapes or {}).get(n, "")))]
    if len(operands) < 2 or operands[0][0] not in EIGHT_BIT:
      continue
    result = _shapes(line.split("=", 1)[1].split(m.group(1) + "(", 1)[0])
    if not result:
      continue
    (dtype, lhs), (_, rhs) = operands[0], operands[1]
    if m.group(1) == "dot":
      c = _CONTRACT.search(line)
      dims = [int(d) for d in (c.group(1) if c else "").split(",") if d]
      flops = 2.0 * math.prod(result[0][1]) * math.prod(lhs[d] for d in dims)
    else:
      flops = _conv_flops(line, lhs, rhs, result[0][1])
    out.append(("xla", dtype, flops))
  return out
