"""gpt-oss from Hugging Face, checked against transformers' recorded outputs; its MXFP4 expert
weights dequantized as transformers decodes them.

Fixture `gpt_oss` (tests/fixtures/make_hf_fixtures.py, transformers 5.23): 4 layers alternating
sliding (window 6) and full attention, attention sinks, q/k/v/o biases, YaRN (truncate false)
from 16 positions, a biased router softmaxing its top-2 of 4 logits, experts with biases and the
clamped SwiGLU at limit 1.0 (both clamps bite), untied; logits, greedy tokens of prompts longer
than the window, and a training loss with the balance loss.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.configs.attention import LayerKind
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError
from shardax.models import hf as hf_models
from shardax.models.hf import gpt_oss, mxfp4
from shardax.sharding import use_rules
from shardax.trainer.hf import importer, safetensors
from hf_helpers import (FIXTURES, assert_config_refused, assert_config_round_trips, assert_export_bit_exact,
                        assert_greedy_matches, assert_logits_match, experiment, imported, reference,
                        train_loss, worst_logit_error)

ARCH = "gpt_oss"


@pytest.fixture(scope="module")
def model():
  return imported(ARCH)


def test_config_maps_onto_the_moe_lm():
  """layer_types -> a (sliding 6, full) pattern; sinks, biases, YaRN without truncation; the
  router's softmax over its chosen k is the renormalized softmax; the experts' clamp."""
  t = experiment(ARCH).model
  m = t.moe
  assert t.layer_pattern == (LayerKind(window=6), LayerKind()) and t.attention_window is None
  assert (t.attention_sinks, t.qkv_bias, t.out_bias, t.qk_norm, t.tied_embedding) == (True, True, True, False, False)
  assert (t.rope_scaling, t.rope_theta) == \
      (RopeScaling("yarn", factor=4.0, original_max_len=16, truncate=False), 150000.0)
  assert (m.num_experts, m.top_k, m.d_ff, m.every, m.score, m.renormalize, m.dispatch) == \
      (4, 2, 32, 1, "softmax", True, "dropless")
  assert (m.router_bias, m.expert_bias, m.swiglu_limit, m.swiglu_alpha) == (True, True, 1.0, 1.702)
  assert m.aux_loss_weight == pytest.approx(0.05 * 2) and m.aux_loss_pooling == "over_layers"


def test_logits_match_transformers(model):
  assert_logits_match(*model, ARCH, show=True)


def test_logits_match_transformers_with_the_experts_split():
  """A (4, 2) mesh with the 'expert' rules (each device one expert of every layer, dropless
  all-to-all): the same logits."""
  setup, params = imported(ARCH, (4, 2), "sharding.preset='expert'")
  assert_logits_match(setup, params, ARCH, rows=4)


def test_unscanned_stack_matches_transformers_too():
  """scan_layers=False: layers/blocks/{u}/blocks/{j} (a unit of the sliding and the full layer)."""
  setup, params = imported(ARCH, (1, 1), "model.scan_layers=False")
  assert params["layers"]["blocks"][1]["blocks"][0]["attn"]["sinks"].shape == (4,)
  assert_logits_match(setup, params, ARCH)


def _without(params, names, value):
  """params with every leaf whose path ends in one of `names` set to `value`."""
  def set_leaf(path, a):
    return jnp.full_like(a, value) if jax.tree_util.keystr(path).endswith(names) else a
  return jax.tree_util.tree_map_with_path(set_leaf, params)


@pytest.mark.parametrize("feature", ["sinks", "expert_bias", "swiglu_clamp", "sliding_window"])
def test_each_feature_moves_the_logits(model, feature):
  """With one gpt-oss feature switched off the logits leave transformers' by far more than the
  tolerance, so each one is exercised by the fixture: sinks at -1e30 (exp = 0: no sink), the
  expert biases 0, no clamp (model.moe.swiglu_limit=None), every layer full (no pattern)."""
  setup, params = model
  if feature == "sinks":
    params = _without(params, ("['sinks']",), -1e30)
  elif feature == "expert_bias":
    params = _without(params, ("['wi_gate_bias']", "['wi_up_bias']", "['wo_bias']"), 0.0)
  else:
    change = {"swiglu_clamp": "model.moe.swiglu_limit=None", "sliding_window": "model.layer_pattern=()"}[feature]
    setup, params = imported(ARCH, (1, 1), change)
  assert worst_logit_error(setup, params, ARCH) > 1e-2


def test_greedy_decode_matches_transformers(model):
  """Prompts longer than the window: the decode cache masks by window on the sliding layers and
  puts the sinks in every step's softmax."""
  assert_greedy_matches(*model, ARCH)


def test_training_loss_matches_transformers(model):
  """loss_and_metrics on transformers' training batch: its cross entropy, its balance loss
  (softmax of the biased router logits, pooled over the layers) and their sum."""
  setup, params = model
  ref = reference(ARCH)
  loss, metrics = train_loss(setup, params, ref["train_tokens"])
  assert metrics["ce_loss"] == pytest.approx(float(ref["train_ce"]), abs=1e-5)
  assert metrics["moe/aux_loss"] * 2 == pytest.approx(float(ref["train_aux"]), abs=1e-5)
  assert loss == pytest.approx(float(ref["train_loss"]), abs=1e-5)


def test_export_is_bit_exact_and_config_round_trips(model, tmp_path):
  """The imported params written back: every tensor bit for bit (the fused gate_up_proj
  re-interleaved from wi_gate / wi_up) and a config.json with every key of the source's
  (make_hf_fixtures.py --check-export OUT gpt_oss loads such an export in transformers)."""
  setup, params = model
  src = os.path.join(FIXTURES, ARCH)
  assert not setup.exp.model.tied_embedding
  assert_export_bit_exact(params, setup.exp.model, ARCH, src, tmp_path)
  out = assert_config_round_trips(gpt_oss, setup.exp.model, ARCH, src)
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(out, f)


# ---------------------------------------------------------------------------------- MXFP4

def _quantize(w):
  """MXFP4 blocks and scales of float32 w [E, in, out] whose values are each exactly an fp4 value
  times their block's power of two (transformers' layout: [E, out, in/32, 16] and [E, out, in/32])."""
  e, n_in, n_out = w.shape
  rows = np.swapaxes(w, 1, 2).reshape(e, n_out, n_in // 32, 32)
  scale = np.log2(np.max(np.abs(rows), axis=-1) / 6.0)
  assert np.all(scale == np.round(scale)), "test values: each block's max is 6 x a power of two"
  mant = rows / np.exp2(scale)[..., None]
  nibble = np.argmin(np.abs(mant[..., None] - mxfp4.FP4_VALUES), axis=-1).astype(np.uint8)
  assert np.array_equal(mxfp4.FP4_VALUES[nibble], mant)
  blocks = (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).astype(np.uint8)
  return blocks, (scale + 127).astype(np.uint8)


def _fp4_weights(rng, shape, low=-6, high=3):
  """float32 values of the form fp4 x 2^k, one k in [low, high) per 32-value block along `in`
  (each block's largest magnitude 6 x 2^k, so its scale is exact)."""
  e, n_in, n_out = shape
  mant = rng.choice(mxfp4.FP4_VALUES, size=(e, n_out, n_in // 32, 32))
  mant[..., 0] = rng.choice([6.0, -6.0], size=mant.shape[:-1])
  k = rng.integers(low, high, size=(e, n_out, n_in // 32, 1)).astype(np.float32)
  return np.swapaxes((mant * np.exp2(k)).reshape(e, n_out, n_in), 1, 2).astype(np.float32)


def test_mxfp4_dequantizes_to_the_values_it_was_built_from():
  """Known fp4 x power-of-two values packed as transformers' convert/dequantize reads them
  (low nibble first, e8m0 scales biased by 127, [E, out, in/32, 16] blocks) come back exactly."""
  w = _fp4_weights(np.random.default_rng(0), (3, 64, 40))
  blocks, scales = _quantize(w)
  assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
  got = mxfp4.dequantize(blocks, scales)
  assert got.dtype == np.float32 and got.shape == w.shape
  np.testing.assert_array_equal(got, w)
  # A known byte: 0x71 holds fp4 index 1 (0.5) then index 7 (6.0); scale 128 = x2.
  b = np.zeros((1, 1, 1, 16), np.uint8)
  b[..., 0] = 0x71
  np.testing.assert_array_equal(mxfp4.dequantize(b, np.full((1, 1, 1), 128, np.uint8))[0, :2, 0], [1.0, 12.0])


def test_mxfp4_checkpoint_imports_as_its_float_weights(tmp_path):
  """The fixture with its expert weights made exactly representable and stored as published
  (`*_blocks` + `*_scales`, quantization_config mxfp4): the import equals importing the same float
  weights unquantized, wi_gate / wi_up the interleaved halves."""
  src = os.path.join(FIXTURES, ARCH)
  plain, packed = str(tmp_path / "plain"), str(tmp_path / "mxfp4")
  reader = safetensors.Reader(src)
  rng = np.random.default_rng(1)
  tensors = {n: reader.get(n) for n in reader.names()}
  quant = {}
  for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
    tensors[name] = _fp4_weights(rng, tensors[name].shape, -10, -5)   # the fixture's widths: whole blocks
    quant[name + "_blocks"], quant[name + "_scales"] = _quantize(tensors[name])
  packed_tensors = {**{n: t for n, t in tensors.items() if n + "_blocks" not in quant}, **quant}
  for d, ts, extra in ((plain, tensors, {}), (packed, packed_tensors, {"quantization_config": {"quant_method": "mxfp4"}})):
    os.makedirs(d)
    names = sorted(ts)
    safetensors.write_model(d, [(n, ts[n].shape, ts[n].dtype) for n in names], lambda n: ts[n], 1 << 30)
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump({**hf_models.read(src), **extra}, f)
    shutil.copy(os.path.join(src, "tokenizer.json"), d)
  assert "model.layers.0.mlp.experts.gate_up_proj" not in safetensors.Reader(packed).names()
  setup, _ = imported(ARCH)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    a = importer.import_params(setup, plain)
    b = importer.import_params(setup, packed)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
  gate_up = tensors["model.layers.2.mlp.experts.gate_up_proj"]
  moe = b["layers"]["blocks"]["blocks"][0]["moe"]
  np.testing.assert_array_equal(np.asarray(moe["wi_up"][1]), gate_up[..., 1::2])


@pytest.mark.parametrize("changes, message", [
    ({"some_new_routing": 2.0}, "some_new_routing"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types"),
    ({"experts_per_token": 3}, "disagree"),
    ({"quantization_config": {"quant_method": "fp8"}}, "mxfp4"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  assert_config_refused(tmp_path, message, ARCH, **changes)


def test_export_refuses_what_gpt_oss_cannot_express():
  model = experiment(ARCH).model
  with pytest.raises(ConfigError, match="attention_sinks=False"):
    gpt_oss.check_exportable(dataclasses.replace(model, attention_sinks=False), ARCH)
  moe = dataclasses.replace(model.moe, swiglu_limit=None)
  with pytest.raises(ConfigError, match="swiglu_limit=None"):
    gpt_oss.check_exportable(dataclasses.replace(model, moe=moe), ARCH)
  pattern = (LayerKind(window=6), LayerKind(window=8))
  with pytest.raises(ConfigError, match="sliding windows"):
    gpt_oss.check_exportable(dataclasses.replace(model, layer_pattern=pattern), ARCH)
