"""RoPE scaling records the attention layers read: YaRN (arXiv 2309.00071) and linear.

`TransformerConfig.rope_scaling_params` returns a `Yarn` when `model.rope_scaling='yarn'`
(DeepSeek-V3, gpt-oss, Qwen long-context checkpoints); layers/rope.py computes its
frequencies. The two scalars here are pure arithmetic on the fields, as transformers'
`_compute_yarn_parameters` (modeling_rope_utils.py) and DeepSeek-V3's attention define them.
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs.errors import require


@dataclasses.dataclass(frozen=True)
class LinearRope:
  """Linear RoPE scaling (position interpolation, arXiv 2306.15595; transformers' 'linear'
  rope_type, Gemma 3's global layers): every frequency divided by `factor`, i.e. positions
  compressed by it."""
  factor: float


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class Yarn:
  """YaRN: frequencies rotating fewer than `beta_slow` times over `original_max_len` are
  interpolated (divided by `factor`), those rotating more than `beta_fast` times kept, a
  linear ramp in between; cos and sin are scaled by `cos_sin_scale`.
    mscale, mscale_all_dim: 0 = absent (as transformers' None); with both set the cos/sin
      scale is mscale(factor, mscale) / mscale(factor, mscale_all_dim), else mscale(factor).
    attention_factor: the cos/sin scale given outright (None: from the mscales).
    truncate: round the ramp's ends to whole dims (transformers' default; gpt-oss: False)."""
  factor: float
  original_max_len: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  attention_factor: float | None = None
  truncate: bool = True

  @property
  def cos_sin_scale(self) -> float:
    """The factor on cos and sin (so on each rotated q and k), transformers' attention_factor."""
    if self.attention_factor is not None:
      return float(self.attention_factor)
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)

  @property
  def softmax_mscale(self) -> float:
    """DeepSeek-V2/V3's extra factor on the softmax scale: mscale(factor, mscale_all_dim)^2
    when mscale_all_dim is set, else 1 (multi-head latent attention applies it; gpt-oss does not)."""
    return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def check_yarn(model) -> None:
  """ConfigError naming the field when a TransformerConfig's YaRN fields are out of range."""
  if model.rope_scaling != "yarn":
    return
  require(model.rope_scaling_factor >= 1 and model.rope_original_max_len >= 1,
          f"model.rope_scaling='yarn' needs rope_scaling_factor >= 1 and rope_original_max_len >= 1 "
          f"(got {model.rope_scaling_factor}, {model.rope_original_max_len})")
  require(model.rope_beta_fast > model.rope_beta_slow > 0,
          f"model.rope_beta_fast={model.rope_beta_fast} must be > model.rope_beta_slow="
          f"{model.rope_beta_slow} > 0 (rotations over the original length: fast dims kept, slow interpolated)")
  require(model.rope_mscale >= 0 and model.rope_mscale_all_dim >= 0,
          f"model.rope_mscale={model.rope_mscale} and rope_mscale_all_dim={model.rope_mscale_all_dim} "
          f"must be >= 0 (0 = absent)")
  require(model.rope_attention_factor is None or model.rope_attention_factor > 0,
          f"model.rope_attention_factor={model.rope_attention_factor} must be > 0 (or None: from the mscales)")


def yarn_of(model) -> Yarn:
  """The `Yarn` record of a TransformerConfig with rope_scaling='yarn'."""
  return Yarn(model.rope_scaling_factor, model.rope_original_max_len, model.rope_beta_fast,
              model.rope_beta_slow, model.rope_mscale, model.rope_mscale_all_dim,
              model.rope_attention_factor, model.rope_truncate)
