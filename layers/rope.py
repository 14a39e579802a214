"""RoPE's rotation frequencies, plain or scaled as a `RopeScaling` (configs/rope.py) says.

RoPE rotates pair i of a d-dim head by position x theta^(-2i/d). A model pretrained on
`original_max_len` tokens and run on more sees, in its slow pairs, angles it never saw; each
scaling kind slows some frequencies down:
  llama3  wavelengths longer than original_max_len / low_freq_factor divided by `factor`,
          shorter than original_max_len / high_freq_factor kept, smoothly in between (Llama 3.1);
  yarn    pairs rotating fewer than `beta_slow` times over the original length divided by
          `factor` (interpolation), more than `beta_fast` times kept (extrapolation: local
          structure untouched), a linear ramp in the pair index between (arXiv 2309.00071;
          `RopeScaling.cos_sin_scale` then scales cos and sin);
  linear  every frequency divided by `factor` (position interpolation, Gemma 3's global layers).
Scaled frequencies are computed in float32 numpy as transformers computes them
(modeling_rope_utils.py), so imported checkpoints rotate the same.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from shardax.configs.rope import RopeScaling


def _base(d: int, theta: float) -> np.ndarray:
  """float32[d/2]: 1 / theta^(2i/d), transformers' float32 arithmetic."""
  return np.float32(1.0) / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))


def llama3_inv_freq(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
  """Llama 3.1's scaling of the frequencies `inv_freq` (float32, as Meta and transformers compute it)."""
  factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
  original = scaling.original_max_len
  inv_freq = np.asarray(inv_freq, np.float32)
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > original / low, inv_freq / np.float32(factor), inv_freq)
  smooth = (np.float32(original) / wavelen - np.float32(low)) / np.float32(high - low)
  smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
  medium = ~(wavelen < original / high) & ~(wavelen > original / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _correction_dim(rotations: float, d: int, theta: float, original_max_len: int) -> float:
  """The (fractional) pair index whose wavelength fits `rotations` times in the original length."""
  return d * math.log(original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inv_freq(d: int, theta: float, yarn: RopeScaling) -> np.ndarray:
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


def rope_inv_freq(d: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
  """float32[d/2] rotation frequencies theta^(-2i/d) of a head of d rotated dims, scaled as
  `scaling` says (None: plain RoPE)."""
  if scaling is None:
    return theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
  if scaling.kind == "yarn":
    return jnp.asarray(yarn_inv_freq(d, theta, scaling))
  if scaling.kind == "linear":
    return jnp.asarray((_base(d, theta) / np.float32(scaling.factor)).astype(np.float32))
  return jnp.asarray(llama3_inv_freq(_base(d, theta), scaling))
