"""YaRN rotary frequencies (arXiv 2309.00071), computed as transformers' `_compute_yarn_parameters`.

RoPE rotates pair i of a d-dim head by position x theta^(-2i/d). A model pretrained on
`original_max_len` tokens and run on `factor` times more sees, in its slow pairs, angles it
never saw; YaRN divides the frequencies of the pairs that rotate fewer than `beta_slow` times
over the original length by `factor` (interpolation), keeps those rotating more than
`beta_fast` times (extrapolation: local structure untouched), and ramps linearly between the
two in the pair index. `Yarn.cos_sin_scale` (configs/rope.py) then scales cos and sin.
float32 throughout, as transformers computes them, so imported checkpoints rotate the same.
"""

from __future__ import annotations

import math

import numpy as np

from shardax.configs.rope import Yarn


def _correction_dim(rotations: float, d: int, theta: float, original_max_len: int) -> float:
  """The (fractional) pair index whose wavelength fits `rotations` times in the original length."""
  return d * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(d: int, theta: float, yarn: Yarn) -> np.ndarray:
  """float32[d/2]: the YaRN-scaled rotation frequencies of a head of d rotated dims."""
  low = _correction_dim(yarn.beta_fast, d, theta, yarn.original_max_len)
  high = _correction_dim(yarn.beta_slow, d, theta, yarn.original_max_len)
  if yarn.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001   # a one-dim ramp would divide by zero
  pos_freqs = np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
  extrapolation = np.float32(1.0) / pos_freqs
  interpolation = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)
  ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
  keep = (np.float32(1.0) - ramp).astype(np.float32)   # 1: the pair keeps its frequency
  return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
