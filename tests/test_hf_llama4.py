"""Llama 4 (text) from Hugging Face, checked against transformers' recorded outputs.

Fixture `llama4` (tests/fixtures/make_hf_fixtures.py, transformers 5.23): 6 layers, NoPE at
layer 3 with temperature tuning (floor_scale 4, so it moves within the prompts), chunked
attention of 8 tokens on the RoPE layers, RoPE of adjacent pairs with llama3 scaling, the
weightless q/k norm after RoPE, MoE layers 1, 3, 5 (sigmoid top-1 of 4 experts scaling the
expert's input, a shared expert), dense layers of intermediate_size_mlp; the stack is one unit
of 4 layers and a tail of 2. Each feature is checked to matter: switched off, the logits move
far from transformers' (`test_each_feature_is_exercised`).
"""

import dataclasses
import json
import os

import numpy as np
import pytest

from shardax import configs
from shardax.configs.attention import LayerKind
from shardax.configs.moe import MoEConfig
from shardax.configs.schema import ConfigError
from shardax.models import hf as hf_models
from shardax.models.hf import common, llama4
from hf_helpers import (FIXTURES, assert_config_round_trips, assert_export_bit_exact, assert_greedy_matches,
                        assert_logits_match, assert_same_tensors, experiment, imported, reference,
                        through_checkpoint, train_loss, worst_logit_error)

ARCH = "llama4"


@pytest.fixture(scope="module")
def model():
  return imported(ARCH)


def test_config_maps_onto_the_lm():
  """no_rope_layers / layer_types / attention_chunk_size -> a pattern of 3 chunked RoPE kinds
  and a NoPE kind with the temperature; the two intermediate sizes; the router."""
  t = experiment(ARCH).model
  chunked, nope = LayerKind(chunk=8), LayerKind(rope=False, temperature_tuning=True)
  assert t.layer_pattern == (chunked, chunked, chunked, nope)
  assert (t.temperature_floor_scale, t.temperature_scale) == (4.0, 0.5)
  assert (t.d_ff, t.head_dim, t.rope_interleave, t.qk_l2_norm, t.qk_norm, t.rope_scaling.kind) == \
      (96, 16, True, True, False, "llama3")
  m = t.moe
  assert (m.num_experts, m.top_k, m.d_ff, m.every, m.score, m.renormalize, m.gate_input, m.num_shared_experts,
          m.dispatch, m.aux_loss_weight) == (4, 1, 32, 2, "sigmoid", False, True, 1, "dropless", 0.0)
  assert (t.num_stack_units, t.num_tail_layers) == (1, 2)


def test_logits_match_transformers(model):
  assert_logits_match(*model, ARCH, rows=4, show=True)


def test_same_logits_with_experts_split_over_4_devices():
  """The 'expert' rules on a (4, 2) mesh: each device one expert of every MoE layer (the
  gate-scaled inputs travel to it by all-to-all); logits as on one device, as transformers'."""
  setup, params = imported(ARCH, (4, 2), "sharding.preset='expert'")
  spec = params["layers"]["blocks"]["blocks"][1]["moe"]["wi_gate"].sharding.spec
  assert any(spec), spec   # the experts are split, not replicated
  assert_logits_match(setup, params, ARCH, rows=4)


def test_unscanned_stack_matches_transformers_too():
  setup, params = imported(ARCH, (1, 1), "model.scan_layers=False")
  assert_logits_match(setup, params, ARCH, rows=4)


# Each feature off (a --set of the imported experiment): the logits must leave transformers'.
FEATURES_OFF = {
    "rope_interleave": "model.rope_interleave=False",
    "qk_l2_norm": "model.qk_l2_norm=False",
    "gate_input": "model.moe.gate_input=False",
    "temperature": "model.temperature_scale=0.0",
    "chunk": "model.layer_pattern=({}, {}, {}, {'rope': False, 'temperature_tuning': True})",
    "nope": "model.layer_pattern=({'chunk': 8}, {'chunk': 8}, {'chunk': 8}, {'chunk': 8})",
}


@pytest.mark.parametrize("feature", sorted(FEATURES_OFF))
def test_each_feature_is_exercised(feature):
  """With the feature switched off the fixture's logits are far from transformers' (so the
  equality tests above fail whenever a feature is broken)."""
  setup, params = imported(ARCH, (1, 1), FEATURES_OFF[feature])
  worst = worst_logit_error(setup, params, ARCH)
  assert worst > 1e-2, f"{feature} off: logits within {worst:.2e} of transformers'"


def test_greedy_decode_matches_transformers(model):
  """Three prompts of 15-32 tokens and 48 new tokens each (past several 8-token chunks, the
  NoPE temperature growing): the decode cache's chunk mask and positions as transformers'."""
  assert_greedy_matches(*model, ARCH)


def test_training_loss_matches_transformers(model):
  """shardax's training loss on transformers' batch (labels = the tokens; the last position
  has no target) equals transformers' loss: the cross entropy alone (no balance loss)."""
  setup, params = model
  ref = reference(ARCH)
  loss, metrics = train_loss(setup, params, ref["train_tokens"])
  print(f"{ARCH}: loss {loss:.6f}, transformers' {float(ref['train_loss']):.6f}")
  assert metrics["ce_loss"] == pytest.approx(float(ref["train_ce"]), abs=1e-5)
  assert loss == pytest.approx(float(ref["train_loss"]), abs=1e-5)


def test_export_is_bit_exact_and_config_round_trips(model, tmp_path):
  """The imported params written back: every tensor bit for bit (the fused gate_up_proj put
  back together from wi_gate and wi_up), and a config.json with every key of the source's."""
  setup, params = model
  src = os.path.join(FIXTURES, ARCH)
  assert not setup.exp.model.tied_embedding
  names = assert_export_bit_exact(params, setup.exp.model, ARCH, src, tmp_path)
  assert "model.layers.5.feed_forward.experts.gate_up_proj" in names
  assert_config_round_trips(llama4, setup.exp.model, ARCH, src)


@pytest.mark.slow   # ~45 s: import, checkpoint and export on 8 devices
def test_checkpoint_round_trip_with_experts_split(tmp_path):
  """Through a step-0 checkpoint on a (4, 2) mesh with the 'expert' rules and back out: the
  same tensors bit for bit (make_hf_fixtures.py --check-export OUT llama4 loads such an export
  in transformers with no missing or unexpected tensor and the recorded logits)."""
  out = through_checkpoint(experiment(ARCH, "mesh.ici=(4, 2)", "sharding.preset='expert'"), tmp_path)
  assert_same_tensors(os.path.join(FIXTURES, ARCH), out)
  assert hf_models.read(out)["no_rope_layers"] == [1, 1, 1, 0, 1, 1]


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_fused_tensor_is_cut_into_leaves_and_joined_back(interleaved):
  """common.Table's `part`: leaf i of n takes a block of the last dim's columns (or, interleaved,
  every n-th from i), and the parts joined give the tensor back."""
  t = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8)
  leaves = [common.Leaf(("w",), ("fused",), (), (2, 3, 4), 0, (i, 2, interleaved)) for i in range(2)]
  parts = [leaf.to_ours(t) for leaf in leaves]
  want = [t[..., 0::2], t[..., 1::2]] if interleaved else [t[..., :4], t[..., 4:]]
  for got, w in zip(parts, want):
    np.testing.assert_array_equal(got, w)
  assert leaves[0].hf_shape == (2, 3, 8)
  np.testing.assert_array_equal(common.join([(leaf, leaf.to_hf(p)) for leaf, p in zip(leaves, parts)]), t)


DROP = object()   # a key left out of config.json


@pytest.mark.parametrize("changes, message", [
    ({"some_new_routing": 2.0}, "some_new_routing"),
    ({"moe_layers": [1, 2, 5]}, "moe_layers"),                 # not every 2nd layer
    ({"moe_layers": DROP, "interleave_moe_layer_step": 4}, "interleave_moe_layer_step=4"),  # 6 layers
    ({"num_experts_per_tok": 2}, "num_experts_per_tok=2"),
    ({"attention_chunk_size": None}, "attention_chunk_size"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  cfg = {**hf_models.read(os.path.join(FIXTURES, ARCH)), **changes}
  d = tmp_path / "m"
  d.mkdir()
  (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not DROP}))
  with pytest.raises(ConfigError, match=message):
    configs.build(configs.get(f"hf:{d}"))


def test_gate_input_is_top_1_dropless_only():
  """model.moe.gate_input (the gate scales the expert's input) is refused by name elsewhere."""
  with pytest.raises(ConfigError, match="gate_input"):
    MoEConfig(top_k=2, gate_input=True, dispatch="dropless", score="sigmoid")
  with pytest.raises(ConfigError, match="gate_input"):
    MoEConfig(top_k=1, gate_input=True, dispatch="capacity")


def test_export_refuses_what_llama4_cannot_express():
  model = experiment(ARCH).model
  with pytest.raises(ConfigError, match="rope_interleave=False"):
    llama4.check_exportable(dataclasses.replace(model, rope_interleave=False), ARCH)
  with pytest.raises(ConfigError, match="num_shared_experts=0"):
    llama4.check_exportable(dataclasses.replace(model, moe=dataclasses.replace(model.moe, num_shared_experts=0)),
                            ARCH)
  windowed = (LayerKind(window=4),) * 3 + (LayerKind(rope=False, temperature_tuning=True),)
  with pytest.raises(ConfigError, match="layer kinds"):
    llama4.check_exportable(dataclasses.replace(model, layer_pattern=windowed), ARCH)


# Llama-4-Maverick-17B-128E's text_config as published (meta-llama config.json), as a
# Llama4ForCausalLM config.json.
MAVERICK_JSON = dict(
    architectures=["Llama4ForCausalLM"], model_type="llama4_text", attention_bias=False, attention_chunk_size=8192,
    attention_dropout=0.0, attn_scale=0.1, attn_temperature_tuning=4, floor_scale=8192, bos_token_id=200000,
    eos_token_id=[200001, 200007, 200008], pad_token_id=200018, head_dim=128, hidden_act="silu", hidden_size=5120,
    initializer_range=0.02, interleave_moe_layer_step=2, intermediate_size=8192, intermediate_size_mlp=16384,
    max_position_embeddings=1048576, num_attention_heads=40, num_experts_per_tok=1, num_hidden_layers=48,
    num_key_value_heads=8, num_local_experts=128, no_rope_layers=[1, 1, 1, 0] * 12, output_router_logits=False,
    rms_norm_eps=1e-5, rope_scaling=None, rope_theta=500000.0, router_aux_loss_coef=0.001, router_jitter_noise=0.0,
    use_qk_norm=False, vocab_size=202048, tie_word_embeddings=False)


def test_the_published_maverick_config_imports_as_shapes_maverick():
  """The model of Maverick's config.json is configs/shapes.py MAVERICK (the pod experiment
  moe.llama4_maverick's), field for field where the config says something; 400.7B params."""
  from shardax.configs import shapes
  t, m = shapes.MAVERICK, shapes.MAVERICK.moe
  fields, moe = llama4.model_fields(MAVERICK_JSON), llama4.moe_fields(MAVERICK_JSON)
  for k, v in fields.items():
    if k != "max_len":   # the shape leaves the context length to its experiments
      assert getattr(t, k) == v, k
  for k, v in moe.items():
    if k not in ("aux_loss_weight",):   # the shape trains with config.json's 1e-3 balance loss
      assert getattr(m, k) == v, k
  assert round(t.param_count() / 1e8) == 4007
