"""RoPE scaling as a config section (configs/rope.py `RopeScaling`), reached from the command line.

`--set model.rope_scaling.kind=K` adds the section to a model without one, its other fields
follow, and the attention layer a Block builds from the config rotates q as the set values say:
checked by the properties each kind is defined by (linear: positions divided by the factor;
llama3 and YaRN: the fastest pair kept, the slowest one interpolated by the factor; factor 1:
plain RoPE), not by recomputing the frequencies. The flat names the section replaced are refused
naming the new path. Numerical equality with transformers is tests/test_mla.py's and the
Hugging Face tests'.
"""

import numpy as np
import pytest
from flax import nnx

from shardax import configs
from shardax.configs import registry
from shardax.configs.rope import MOVED, RopeScaling
from shardax.configs.schema import ConfigError
from shardax.layers.blocks import Block

SMALL = ["model.d_model=128", "model.num_heads=2"]   # one head of 64 rotated dims per head
D = 64
B, L = 2, 8


def rotated_q(overrides: list[str], positions: np.ndarray) -> np.ndarray:
  """q [b, l, heads, 64] of lm.tiny's first attention layer with `overrides`, its RoPE applied
  at `positions` (same params whatever the overrides: seed 0)."""
  exp = configs.resolve("lm.tiny", SMALL + overrides)
  with nnx.use_eager_sharding(False):
    attn = Block(exp.model, rngs=nnx.Rngs(0)).attn
  x = np.random.default_rng(0).normal(size=(B, L, 128)).astype(np.float32)
  return np.asarray(attn._query(x, np.broadcast_to(positions, (B, L))))


def pair(q: np.ndarray, i: int) -> np.ndarray:
  """The two dims RoPE rotates together as pair i (rotate-half: i and i + d/2)."""
  return q[..., [i, i + D // 2]]


POS = np.arange(L)
FACTOR = 8


def test_linear_from_the_command_line_divides_every_position_by_its_factor():
  scaled = rotated_q(["model.rope_scaling.kind='linear'", f"model.rope_scaling.factor={FACTOR}.0"], POS * FACTOR)
  np.testing.assert_allclose(scaled, rotated_q([], POS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,fields", [
    ("llama3", ["model.rope_scaling.original_max_len=8192"]),
    ("yarn", ["model.rope_scaling.original_max_len=8192", "model.rope_scaling.attention_factor=1.0"]),
])
def test_llama3_and_yarn_from_the_command_line_keep_fast_pairs_and_interpolate_slow_ones(kind, fields):
  """Over 8192 original positions the fastest pair turns ~1300 times (kept) and the slowest
  one under once (divided by the factor). YaRN's cos/sin scale is set to 1 (attention_factor),
  so both kinds' slow pair at positions x factor is plain RoPE's at the positions."""
  section = [f"model.rope_scaling.kind='{kind}'", f"model.rope_scaling.factor={FACTOR}.0"] + fields
  plain = rotated_q([], POS)
  np.testing.assert_allclose(pair(rotated_q(section, POS), 0), pair(plain, 0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(pair(rotated_q(section, POS * FACTOR), D // 2 - 1), pair(plain, D // 2 - 1),
                             rtol=1e-5, atol=1e-5)
  assert np.abs(pair(rotated_q(section, POS), D // 2 - 1) - pair(plain, D // 2 - 1)).max() > 1e-4


@pytest.mark.parametrize("kind", ["llama3", "yarn", "linear"])
def test_factor_1_is_plain_rope_and_the_set_factor_changes_q(kind):
  section = [f"model.rope_scaling.kind='{kind}'"]
  plain = rotated_q([], POS * 100)
  np.testing.assert_allclose(rotated_q(section + ["model.rope_scaling.factor=1.0"], POS * 100), plain,
                             rtol=1e-4, atol=1e-4)   # angles to 700: float32 frequencies computed two ways
  four, forty = (rotated_q(section + [f"model.rope_scaling.factor={f}"], POS * 100) for f in (4.0, 40.0))
  assert np.abs(four - forty).max() > 1e-3


def test_the_yarn_fields_set_on_the_command_line_are_the_section():
  exp = configs.resolve("lm.tiny", [
      "model.rope_scaling.kind='yarn'", "model.rope_scaling.factor=40.0", "model.rope_scaling.original_max_len=4096",
      "model.rope_scaling.beta_fast=16.0", "model.rope_scaling.beta_slow=2.0", "model.rope_scaling.mscale=1.0",
      "model.rope_scaling.mscale_all_dim=1.0", "model.rope_scaling.truncate=False"])
  assert exp.model.rope_scaling == RopeScaling("yarn", factor=40.0, original_max_len=4096, beta_fast=16.0,
                                               beta_slow=2.0, mscale=1.0, mscale_all_dim=1.0, truncate=False)


def test_an_experiment_with_scaling_changes_or_drops_it_from_the_command_line():
  assert configs.resolve("lm.llama3_8b_32k").model.rope_scaling == RopeScaling("llama3")
  assert configs.resolve("lm.llama3_8b_32k", ["model.rope_scaling.factor=16.0"]).model.rope_scaling.factor == 16.0
  assert configs.resolve("lm.llama3_8b_32k", ["model.rope_scaling=None"]).model.rope_scaling is None


def test_another_kind_starts_afresh_as_the_refusal_says():
  """gpt-oss's YaRN sets original_max_len and truncate, which 'linear' does not read: switching
  the kind alone is refused naming them; dropping the section first gives a fresh one."""
  with pytest.raises(ConfigError, match=r"does not read original_max_len=4096, truncate=False"):
    configs.resolve("moe.gpt_oss_120b", ["model.rope_scaling.kind='linear'"])
  fresh = configs.resolve("moe.gpt_oss_120b", ["model.rope_scaling=None", "model.rope_scaling.kind='linear'",
                                               "model.rope_scaling.factor=2.0"])
  assert fresh.model.rope_scaling == RopeScaling("linear", factor=2.0)


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_the_former_flat_names_are_refused_naming_the_section_path(old, new):
  with pytest.raises(ConfigError, match=f"use --set {new.replace('.', '[.]')}=3"):
    configs.resolve("lm.tiny", [f"{old}=3"])


def test_the_former_string_value_is_refused_naming_the_kind():
  with pytest.raises(ConfigError, match=r"--set model\.rope_scaling\.kind='yarn'"):
    configs.resolve("lm.tiny", ["model.rope_scaling='yarn'"])
  with pytest.raises(ConfigError, match=r"model\.rope_scaling=None"):
    configs.resolve("lm.tiny", ["model.rope_scaling='none'"])


def test_a_field_without_the_kind_is_refused_naming_the_switch():
  with pytest.raises(ConfigError, match=r"--set model\.rope_scaling\.kind='llama3'\|'yarn'\|'linear'"):
    configs.resolve("lm.tiny", ["model.rope_scaling.factor=4.0"])
  assert registry.SECTION_SWITCHES[RopeScaling] == "kind"


@pytest.mark.parametrize("fields,named", [
    (dict(kind="ntk"), "model.rope_scaling.kind='ntk'"),
    (dict(kind="linear", factor=0.0), "model.rope_scaling.factor=0.0 must be > 0"),
    (dict(kind="linear", beta_fast=16.0), "does not read beta_fast=16.0"),
    (dict(kind="llama3", mscale=1.0), "does not read mscale=1.0"),
    (dict(kind="yarn", low_freq_factor=2.0), "does not read low_freq_factor=2.0"),
    (dict(kind="llama3", factor=0.5), "needs factor >= 1"),
    (dict(kind="llama3", low_freq_factor=4.0, high_freq_factor=4.0), "high_freq_factor=4.0 must be >"),
    (dict(kind="yarn", beta_fast=1.0, beta_slow=1.0), "beta_fast=1.0 must be >"),
    (dict(kind="yarn", mscale=-1.0), "mscale=-1.0 and mscale_all_dim=0.0 must be >= 0"),
    (dict(kind="yarn", attention_factor=0.0), "attention_factor=0.0 must be > 0"),
])
def test_bad_sections_are_refused_by_field(fields, named):
  with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
    RopeScaling(**fields)


MLA = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=12", "model.mla.qk_nope_head_dim=8",
       "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6"]


def test_the_models_rope_interleave_reaches_multi_head_latent_attention():
  """One flag for every attention: model.rope_interleave rotates MLA's adjacent RoPE pairs
  (DeepSeek's checkpoints; tests/test_hf_deepseek_v3.py checks the result against transformers)."""
  x = np.random.default_rng(1).normal(size=(B, L, 128)).astype(np.float32)
  pos = np.broadcast_to(POS * 3, (B, L))
  qs = []
  for interleave in (False, True):
    exp = configs.resolve("lm.tiny", SMALL + MLA + [f"model.rope_interleave={interleave}"])
    with nnx.use_eager_sharding(False):
      attn = Block(exp.model, rngs=nnx.Rngs(0)).attn
    assert attn.rope_interleave is interleave
    qs.append(np.asarray(attn._queries(x, pos)[1]))
  assert np.abs(qs[0] - qs[1]).max() > 1e-3
