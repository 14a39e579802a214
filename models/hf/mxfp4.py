"""MXFP4 expert weights (gpt-oss as published), dequantized on import.

Such a config.json carries `quantization_config` = {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}: every expert weight W [E, in, out] (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) is stored as two uint8 tensors,
  W_blocks [E, out, in / 32, 16]: 32 fp4 (e2m1) values a block, two a byte, the low nibble first;
  W_scales [E, out, in / 32]:     each block's e8m0 exponent (biased by 127);
and W[e, i, o] = FP4[nibble i % 32 of block (e, o, i // 32)] x 2^(scale[e, o, i // 32] - 127),
as transformers' integrations/mxfp4.py (`convert_moe_packed_tensors`) decodes it, including its
transpose to [E, in, out]. Every other tensor (attention, norms, router, biases, embeddings: the
modules_to_not_convert) is stored plain. `dequantizing(reader, hf)` wraps a tensor reader so the
walk sees float32 `W` under its own name and never the blocks or scales. Exports are written
dequantized (no quantization_config): shardax trains the float weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardax.configs.schema import ConfigError

# e2m1: sign, 2 exponent bits, 1 mantissa bit; the index is the nibble.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(hf: dict[str, Any]) -> bool:
  """Whether config.json `hf` declares MXFP4 weights (the family's model_fields refuses other
  quantization methods by name)."""
  return (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 W [E, in, out] of blocks uint8 [E, out, in / 32, 16] and scales uint8 [E, out, in / 32]."""
  blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
  if blocks.ndim != 4 or blocks.shape[:-1] != scales.shape:
    raise ConfigError(f"mxfp4 blocks {blocks.shape} and scales {scales.shape}: expected [E, out, in/32, 16] "
                      f"and [E, out, in/32]")
  e, out, groups, width = blocks.shape
  values = np.empty((e, out, groups, 2 * width), np.float32)
  values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
  values[..., 1::2] = FP4_VALUES[blocks >> 4]
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return np.ascontiguousarray(values.reshape(e, out, groups * 2 * width).swapaxes(1, 2))


class Dequantizing:
  """A tensor reader (names, shape, get) over another, showing each W_blocks + W_scales pair as
  the float32 tensor W."""

  def __init__(self, reader):
    self.reader = reader
    names = reader.names()
    self._packed = {n[:-len(BLOCKS)] for n in names if n.endswith(BLOCKS) and n[:-len(BLOCKS)] + SCALES in names}
    hidden = {p + s for p in self._packed for s in (BLOCKS, SCALES)}
    self._names = sorted([n for n in names if n not in hidden] + list(self._packed))

  def names(self) -> list[str]:
    return self._names

  def shape(self, name: str) -> tuple[int, ...]:
    if name not in self._packed:
      return tuple(self.reader.shape(name))
    e, out, groups, width = self.reader.shape(name + BLOCKS)
    return (e, groups * 2 * width, out)

  def get(self, name: str) -> np.ndarray:
    if name not in self._packed:
      return self.reader.get(name)
    return dequantize(self.reader.get(name + BLOCKS), self.reader.get(name + SCALES))


def dequantizing(reader, hf: dict[str, Any]):
  """`reader`, dequantizing when config.json `hf` says the experts are MXFP4 (else itself)."""
  return Dequantizing(reader) if is_mxfp4(hf) else reader
