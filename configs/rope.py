"""RoPE frequency scaling, the LM config's `rope_scaling` section: `TransformerConfig(...,
rope_scaling=RopeScaling("yarn", factor=32.0, original_max_len=4096))`.

Composed like `mla`: None = plain RoPE; set, every layer that rotates (and whose layer kind has
`rope_scaled`) scales its frequencies as `kind` says (layers/rope.py computes them):
  'llama3'  Llama 3.1's frequency-dependent scaling (factor, low/high_freq_factor, original_max_len);
  'yarn'    YaRN, arXiv 2309.00071 (DeepSeek-V3, gpt-oss, Qwen long context: factor,
            original_max_len, beta_fast/slow, mscale, mscale_all_dim, attention_factor, truncate);
  'linear'  position interpolation, arXiv 2306.15595 (Gemma 3's global layers: factor).
On the command line `--set model.rope_scaling.kind='yarn'` adds the section to a model without
one (then `--set model.rope_scaling.factor=40` ...); `--set model.rope_scaling=None` removes it.
A field the kind does not read must stay at its default, so no setting is silently ignored.
The two YaRN scalars are pure arithmetic on the fields, as transformers' `_compute_yarn_parameters`
(modeling_rope_utils.py) and DeepSeek-V3's attention define them.
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs.errors import require

# The fields each kind reads (the others stay at their defaults).
KIND_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"),
    "yarn": ("factor", "original_max_len", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
    "linear": ("factor",),
}
KINDS = tuple(KIND_FIELDS)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How RoPE's frequencies are scaled (transformers' rope_parameters names in brackets).
    kind: 'llama3' | 'yarn' | 'linear' [rope_type].
    factor: llama3: wavelengths beyond the original length stretched by this; yarn: the
      interpolated frequencies divided by it; linear: every frequency divided by it [factor].
    low_freq_factor, high_freq_factor (llama3): wavelengths above original_max_len / low are
      scaled in full, below original_max_len / high not at all, smoothly in between.
    original_max_len (llama3, yarn): the context length the model was pretrained at
      [original_max_position_embeddings].
    beta_fast, beta_slow (yarn): frequencies rotating fewer than beta_slow times over the
      original length are interpolated, those rotating more than beta_fast kept, a linear
      ramp in between.
    mscale, mscale_all_dim (yarn): magnitude corrections, 0 = absent (transformers' None); with
      both set the cos/sin scale is mscale(factor, mscale) / mscale(factor, mscale_all_dim),
      else mscale(factor).
    attention_factor (yarn): the cos/sin scale given outright; None = from the mscales.
    truncate (yarn): round the ramp's ends to whole dims (transformers' default; gpt-oss: False)."""
  kind: str
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_len: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0
  mscale_all_dim: float = 0.0
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    require(self.kind in KINDS,
            f"model.rope_scaling.kind={self.kind!r}: use one of {KINDS} (plain RoPE: model.rope_scaling=None)")
    ignored = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
               if f.name != "kind" and f.name not in KIND_FIELDS[self.kind] and getattr(self, f.name) != f.default]
    require(not ignored,
            f"model.rope_scaling.kind={self.kind!r} does not read {', '.join(ignored)} (it reads "
            f"{', '.join(KIND_FIELDS[self.kind])}); reset them, or start the section afresh with "
            f"--set model.rope_scaling=None --set model.rope_scaling.kind={self.kind!r}")
    if self.kind == "linear":
      require(self.factor > 0, f"model.rope_scaling.factor={self.factor} must be > 0 ('linear')")
      return
    require(self.factor >= 1 and self.original_max_len >= 1,
            f"model.rope_scaling.kind={self.kind!r} needs factor >= 1 and original_max_len >= 1 "
            f"(got model.rope_scaling.factor={self.factor}, original_max_len={self.original_max_len})")
    if self.kind == "llama3":
      require(self.high_freq_factor > self.low_freq_factor > 0,
              f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must be > "
              f"model.rope_scaling.low_freq_factor={self.low_freq_factor} > 0 ('llama3')")
      return
    require(self.beta_fast > self.beta_slow > 0,
            f"model.rope_scaling.beta_fast={self.beta_fast} must be > model.rope_scaling.beta_slow="
            f"{self.beta_slow} > 0 (rotations over the original length: fast dims kept, slow interpolated)")
    require(self.mscale >= 0 and self.mscale_all_dim >= 0,
            f"model.rope_scaling.mscale={self.mscale} and mscale_all_dim={self.mscale_all_dim} "
            f"must be >= 0 (0 = absent)")
    require(self.attention_factor is None or self.attention_factor > 0,
            f"model.rope_scaling.attention_factor={self.attention_factor} must be > 0 (or None: from the mscales)")

  @property
  def cos_sin_scale(self) -> float:
    """The factor on cos and sin (so on each rotated q and k), transformers' attention_factor:
    YaRN's, 1 for the other kinds."""
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)
    if self.mscale and self.mscale_all_dim:
      return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    return yarn_mscale(self.factor)

  @property
  def softmax_mscale(self) -> float:
    """DeepSeek-V2/V3's extra factor on the softmax scale: mscale(factor, mscale_all_dim)^2
    when a YaRN section sets mscale_all_dim, else 1 (multi-head latent attention applies it;
    gpt-oss does not)."""
    if self.kind != "yarn" or not self.mscale_all_dim:
      return 1.0
    return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def check_section(value) -> None:
  """ConfigError naming the new spelling when `model.rope_scaling` is not a RopeScaling or None
  (the string the field held before it became a section)."""
  if value is None or isinstance(value, RopeScaling):
    return
  if value == "none":
    require(False, "model.rope_scaling='none': plain RoPE is model.rope_scaling=None "
                   "(--set model.rope_scaling=None)")
  require(False, f"model.rope_scaling={value!r}: RoPE scaling is a section (configs/rope.py RopeScaling); "
                 f"use --set model.rope_scaling.kind={value!r} and its fields (model.rope_scaling.factor, "
                 f"...), or model.rope_scaling=None for plain RoPE")


# Former paths of RoPE's fields -> where they are now (configs/registry.py refuses the old paths
# naming the new one): the flat fields RoPE scaling had before it was a section, and MLA's own
# interleave flag.
MOVED = {f"model.{old}": f"model.rope_scaling.{new}" for old, new in (
    ("rope_scaling_factor", "factor"), ("rope_low_freq_factor", "low_freq_factor"),
    ("rope_high_freq_factor", "high_freq_factor"), ("rope_original_max_len", "original_max_len"),
    ("rope_beta_fast", "beta_fast"), ("rope_beta_slow", "beta_slow"), ("rope_mscale", "mscale"),
    ("rope_mscale_all_dim", "mscale_all_dim"), ("rope_attention_factor", "attention_factor"),
    ("rope_truncate", "truncate"))}
MOVED["model.mla.rope_interleave"] = "model.rope_interleave"   # one field serves every attention
