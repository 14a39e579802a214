"""Gemma 3 (text) and Gemma 2 from Hugging Face, checked against transformers' recorded outputs.

Fixtures (tests/fixtures/make_hf_fixtures.py, transformers 5.23): `gemma3` (8 layers of a
(sliding, sliding, full) pattern: 2 units and a tail of 2; window 6; local RoPE base 1e4
unscaled, global 1e6 with linear scaling x8; q/k norms; query_pre_attn_scalar 24 with head_dim
16; tied) and `gemma2` (4 layers alternating sliding and full; final-logit and attention
soft-caps 8 and 5; query_pre_attn_scalar 32; untied), each with logits, greedy tokens after a
short prompt and after three prompts longer than the window, and a training loss.
"""

import copy
import dataclasses
import os

import pytest

from shardax.configs.attention import LayerKind
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError
from shardax.models import hf as hf_models
from shardax.models.hf import gemma
from hf_helpers import (FIXTURES, assert_config_refused, assert_config_round_trips, assert_export_bit_exact,
                        assert_greedy_matches, assert_logits_match, experiment, imported, reference,
                        train_loss)

ARCHS = ("gemma3", "gemma2")
HF_ARCH = {"gemma3": "gemma3_text", "gemma2": "gemma2"}
LOCAL3 = LayerKind(window=6, rope_theta=10000.0, rope_scaled=False)


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
  setup, params = imported(request.param)
  return request.param, setup, params


def test_config_maps_onto_the_lm():
  """layer_types -> a pattern of 3 kinds with a tail of 2; the local RoPE base unscaled, the
  global one linearly scaled; Gemma's norms, scales and caps."""
  t = experiment("gemma3").model
  assert t.layer_pattern == (LOCAL3, LOCAL3, LayerKind()) and t.num_tail_layers == 2
  assert (t.rope_theta, t.rope_scaling) == (1e6, RopeScaling("linear", factor=8.0))
  assert (t.norm, t.post_norms, t.qk_norm, t.activation, t.scale_embedding, t.tied_embedding) == \
      ("rms_plus_one", True, True, "gelu", True, True)
  assert (t.query_pre_attn_scalar, t.head_dim, t.attention_softcap, t.final_logit_softcap) == (24.0, 16, None, None)
  t = experiment("gemma2").model
  assert t.layer_pattern == (LayerKind(window=6), LayerKind()) and t.rope_scaling is None
  assert (t.qk_norm, t.attention_softcap, t.final_logit_softcap, t.tied_embedding) == (False, 5.0, 8.0, False)


def test_logits_match_transformers(arch_model):
  arch, setup, params = arch_model
  assert_logits_match(setup, params, arch, show=True)


def test_greedy_decode_matches_transformers(arch_model):
  """A short prompt, then three prompts longer than the window in one batch (cached decode
  past the window on the local layers)."""
  arch, setup, params = arch_model
  assert_greedy_matches(setup, params, arch)


def test_training_loss_matches_transformers(arch_model):
  """loss_and_metrics on transformers' training batch (labels = the tokens: the last position
  has no target) equals transformers' loss."""
  arch, setup, params = arch_model
  ref = reference(arch)
  loss, _ = train_loss(setup, params, ref["train_tokens"])
  assert loss == pytest.approx(float(ref["train_loss"]), abs=1e-5)


def test_sharded_import_matches_transformers():
  """gemma3 imported onto a (2, 4) mesh with the 2d rules (kv heads whole): the same logits."""
  from shardax.sharding import rules as rules_lib
  rules = tuple(r for r in rules_lib.PRESETS["2d"] if r[0] != "kv_heads")
  setup, params = imported("gemma3", (2, 4), f"sharding.rules={rules!r}")
  assert_logits_match(setup, params, "gemma3", rows=4)


def test_export_is_bit_exact_and_config_round_trips(arch_model, tmp_path):
  """The imported params written back: the source's tensors bit for bit (w of every norm, not
  1 + w; the tied head left out) and a config.json with every key of the source's."""
  arch, setup, params = arch_model
  src = os.path.join(FIXTURES, arch)
  assert_export_bit_exact(params, setup.exp.model, HF_ARCH[arch], src, tmp_path)
  assert_config_round_trips(gemma, setup.exp.model, HF_ARCH[arch], src)


def hub_gemma3(**changes):
  """The fixture's config.json as the hub spells Gemma 3's (rope_theta, rope_local_base_freq,
  rope_scaling, sliding_window_pattern; no layer_types)."""
  cfg = copy.deepcopy(hf_models.read(os.path.join(FIXTURES, "gemma3")))
  for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
    cfg.pop(key)
  cfg.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"factor": 8.0, "rope_type": "linear"},
             sliding_window_pattern=3, num_hidden_layers=6, cache_implementation="hybrid")
  cfg.update(changes)
  return cfg


def test_hub_spelling_imports_as_the_same_model():
  """Gemma 3's hub keys give the fields transformers 5's spelling gives (6 layers: no tail)."""
  src = dict(hf_models.read(os.path.join(FIXTURES, "gemma3")), num_hidden_layers=6)
  src["layer_types"] = src["layer_types"][:6]
  assert gemma.model_fields(hub_gemma3()) == gemma.model_fields(src)
  fields = gemma.model_fields(hub_gemma3(rope_scaling=None, num_hidden_layers=26, sliding_window_pattern=6))
  assert fields["rope_scaling"] is None and fields["layer_pattern"][0].rope_scaled
  assert len(fields["layer_pattern"]) == 6 and fields["num_layers"] == 26   # 4 units and a tail of 2


@pytest.mark.parametrize("changes, message", [
    ({"some_new_gemma_key": 1}, "some_new_gemma_key"),
    ({"layer_types": ["full_attention"] + ["sliding_attention"] * 7}, "not a repeating pattern"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0},
                          "full_attention": {"rope_type": "default"}}}, "rope for sliding_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                          "full_attention": {"rope_type": "linear", "factor": 8.0}}}, "linear factors"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "keyed by layer type"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"sliding_window_size": 8}, "sliding_window_size=8"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  assert_config_refused(tmp_path, message, "gemma3", **changes)


def test_export_refuses_what_gemma_cannot_express():
  model = experiment("gemma3").model
  with pytest.raises(ConfigError, match="post_norms=False"):
    gemma.check_exportable(dataclasses.replace(model, post_norms=False), "gemma3_text")
  with pytest.raises(ConfigError, match="sliding layer kinds that differ"):
    gemma.check_exportable(dataclasses.replace(model, layer_pattern=(LOCAL3, LayerKind(window=3), LayerKind())),
                           "gemma3_text")
  with pytest.raises(ConfigError, match="Gemma 2 has one RoPE"):
    gemma.check_exportable(dataclasses.replace(model, qk_norm=False), "gemma2")


def test_published_gemma3_27b_config_imports_as_the_pod_shape():
  """Gemma-3-27B's text config as the hub spells it (rope_theta / rope_local_base_freq /
  rope_scaling, sliding_window_pattern 6 over 62 layers) builds configs/shapes.py GEMMA3_27B,
  the shape of the pod experiment lm.gemma3_27b: 10 units of 6 layers and a tail of 2."""
  from shardax.configs import shapes
  from shardax.configs.schema import TransformerConfig
  hub = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
         "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
         "final_logit_softcapping": None, "head_dim": 128, "hidden_activation": "gelu_pytorch_tanh",
         "hidden_size": 5376, "initializer_range": 0.02, "intermediate_size": 21504,
         "max_position_embeddings": 131072, "model_type": "gemma3_text", "num_attention_heads": 32,
         "num_hidden_layers": 62, "num_key_value_heads": 16, "pad_token_id": 0, "query_pre_attn_scalar": 168,
         "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
         "rope_theta": 1000000.0, "sliding_window": 1024, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
         "use_cache": True, "vocab_size": 262208}
  model = TransformerConfig(**gemma.model_fields(hub))
  assert model == shapes.GEMMA3_27B
  assert (model.num_stack_units, model.num_tail_layers) == (10, 2)
  assert round(model.param_count() / 1e9, 2) == 27.01
  out = gemma.to_hf(model, "gemma3_text", hub)
  assert {k: out.get(k) for k in hub} == hub


def test_gemma2_hub_config_imports():
  """Gemma-2-9B's config.json as the hub has it (hidden_act beside hidden_activation,
  sliding_window_size, no layer_types): alternating window-4096 and global layers, 21 units,
  both soft-caps, no q/k norm."""
  hub = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
         "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
         "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
         "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
         "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
         "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
         "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
         "sliding_window_size": 4096, "torch_dtype": "float32", "use_cache": True, "vocab_size": 256000}
  fields = gemma.model_fields(hub)
  assert fields["layer_pattern"] == (LayerKind(window=4096), LayerKind()) and fields["num_layers"] == 42
  assert (fields["attention_softcap"], fields["final_logit_softcap"], fields["qk_norm"]) == (50.0, 30.0, False)
  assert (fields["rope_theta"], fields["rope_scaling"]) == (10000.0, None)
  from shardax.configs.schema import TransformerConfig
  out = gemma.to_hf(TransformerConfig(**fields), "gemma2", hub)
  assert {k: out.get(k) for k in hub} == hub
