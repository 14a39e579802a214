"""fp8 checkpoints with per-block inverse scales (DeepSeek-V3 as published), dequantized on import.

Such a config.json carries `quantization_config` = {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}: each quantized linear
weight W [M, N] is stored as float8_e4m3fn beside `W_scale_inv` float32 [ceil(M/128),
ceil(N/128)], and W = fp8(W) x the scale of its 128 x 128 block (DeepSeek's `weight_dequant`).
Norms, embeddings and the router stay in their own dtype. `dequantizing(reader, hf)` wraps a
tensor reader so the walk sees the dequantized float32 weights under their own names and
never the scales; the activation scheme is an inference setting (shardax trains in the
model's dtype, or in 8 bits with model.quantization), so only the weights matter here.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardax.configs.schema import ConfigError

SCALE_SUFFIX = "_scale_inv"


def check(quant: dict[str, Any] | None) -> tuple[int, int] | None:
  """The (rows, cols) weight block of a config.json `quantization_config` shardax dequantizes;
  None without one; a ConfigError naming the field for any other scheme."""
  if not quant:
    return None
  method = quant.get("quant_method")
  if method != "fp8":
    raise ConfigError(f"config.json quantization_config.quant_method={method!r}: shardax dequantizes "
                      f"'fp8' checkpoints with per-block scales only")
  fmt = quant.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise ConfigError(f"config.json quantization_config.fmt={fmt!r}: only 'e4m3' is read")
  block = quant.get("weight_block_size")
  if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) >= 1 for b in block)):
    raise ConfigError(f"config.json quantization_config.weight_block_size={block!r}: give [rows, cols] "
                      f"(DeepSeek-V3: [128, 128]); per-tensor fp8 scales are not read")
  return int(block[0]), int(block[1])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """float32 W = weight x scale_inv[i // rows, j // cols] for weight [M, N] (any dtype numpy
  casts to float32, float8_e4m3fn included) and scale_inv [ceil(M / rows), ceil(N / cols)]."""
  m, n = weight.shape
  want = (math.ceil(m / block[0]), math.ceil(n / block[1]))
  if tuple(scale_inv.shape) != want:
    raise ConfigError(f"fp8 weight {weight.shape} with block {block} needs scales {want}, got "
                      f"{tuple(scale_inv.shape)}")
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)[:m, :n]
  return weight.astype(np.float32) * scale


class Dequantizing:
  """A tensor reader (names, shape, get) over another whose quantized weights it dequantizes."""

  def __init__(self, reader, block: tuple[int, int]):
    self.reader, self.block = reader, block
    self._names = [n for n in reader.names() if not n.endswith(SCALE_SUFFIX)]
    self._scaled = {n[:-len(SCALE_SUFFIX)] for n in reader.names() if n.endswith(SCALE_SUFFIX)}

  def names(self) -> list[str]:
    return self._names

  def shape(self, name: str) -> tuple[int, ...]:
    return self.reader.shape(name)

  def get(self, name: str) -> np.ndarray:
    t = self.reader.get(name)
    if name not in self._scaled:
      return t
    return dequantize(t, self.reader.get(name + SCALE_SUFFIX), self.block)


def dequantizing(reader, hf: dict[str, Any]):
  """`reader`, dequantizing when config.json `hf` says the weights are block-scaled fp8."""
  block = check(hf.get("quantization_config"))
  return reader if block is None else Dequantizing(reader, block)
