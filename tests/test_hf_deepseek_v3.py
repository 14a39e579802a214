"""DeepSeek-V3 from Hugging Face (models/hf/deepseek_v3.py), checked against transformers' recorded
outputs: multi-head latent attention (q LoRA, interleaved RoPE, YaRN with its mscale), the
group-limited sigmoid router with its selection bias, shared experts, a first dense layer.

Fixture (tests/fixtures/make_hf_fixtures.py, transformers 5.23): `deepseek_v3`, 3 layers, layer 0
dense, top-2 of 8 experts in 2 of 4 groups; logits of three sequences, greedy tokens of a
prompt and of three longer ones.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.configs.rope import RopeScaling
from shardax.models import hf as hf_models
from shardax.models.hf import deepseek_v3
from shardax.sharding import use_rules
from shardax.trainer.hf import safetensors
from hf_helpers import (FIXTURES, assert_config_refused, assert_config_round_trips, assert_export_bit_exact,
                        assert_export_dequantized, assert_greedy_matches, assert_logits_match, experiment, imported, imported_from,
                        reference, worst_logit_error)

ARCH = "deepseek_v3"


@pytest.fixture(scope="module")
def model():
  return imported(ARCH)


def test_config_maps_onto_mla_and_the_group_limited_moe():
  t = experiment(ARCH).model
  a, m = t.mla, t.moe
  assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
          t.rope_interleave) == (24, 16, 16, 8, 12, True)
  assert t.rope_scaling == RopeScaling("yarn", factor=4.0, original_max_len=16, mscale=1.0, mscale_all_dim=0.5)
  assert (m.num_experts, m.top_k, m.n_group, m.topk_group, m.d_ff, m.num_shared_experts,
          m.first_dense_layers, m.score, m.gate_scale, m.renormalize) == (8, 2, 4, 2, 32, 1, 1, "sigmoid", 2.5, True)
  assert m.bias_update_rate > 0 and m.aux_loss_weight == 0


def test_logits_match_transformers(model):
  assert_logits_match(*model, ARCH)


def test_expert_parallel_import_matches_transformers():
  """On (4, 2) with the 'expert' rules: the experts split over data, the tokens exchanged."""
  setup, params = imported(ARCH, (4, 2), "sharding.preset='expert'")
  assert params["layers"]["blocks"]["moe_block"]["moe"]["wi_gate"].sharding.spec[1] == "data"
  assert_logits_match(setup, params, ARCH, rows=4)


def test_unscanned_stack_matches_transformers_too():
  setup, params = imported(ARCH, (1, 1), "model.scan_layers=False")
  assert params["layers"]["blocks"][1]["moe_block"]["attn"]["kv_up"]["kernel"].shape == (16, 4, 16 + 12)
  assert_logits_match(setup, params, ARCH)


@pytest.mark.parametrize("feature", ["group limit", "interleaved RoPE", "softmax mscale"])
def test_each_feature_of_the_fixture_changes_its_logits(feature):
  """The fixture exercises the group limit, the interleaved RoPE and YaRN's softmax mscale: any
  of them switched off moves the logits well past the tolerance."""
  cfg = configs.get(f"hf:{os.path.join(FIXTURES, ARCH)}")
  if feature == "group limit":
    cfg.model.moe.n_group, cfg.model.moe.topk_group = 1, 1
  elif feature == "interleaved RoPE":
    cfg.model.rope_interleave = False
  else:
    cfg.model.rope_scaling.mscale_all_dim = 0.0
  setup, params = _imported_from(cfg)
  worst = worst_logit_error(setup, params, ARCH)
  assert worst > 1e-2, (feature, worst)


def _imported_from(cfg, source=os.path.join(FIXTURES, ARCH)):
  configs.apply_overrides(cfg, ["mesh.ici=(1, 1)"])
  return imported_from(configs.build(cfg), source)


def test_greedy_decode_over_the_latent_cache_matches_transformers(model):
  assert_greedy_matches(*model, ARCH)


def test_training_loss_is_the_cross_entropy_of_transformers_logits(model):
  """loss_and_metrics on the longest recorded sequence: its mean next-token cross entropy under
  transformers' logits (aux_loss_weight 0, as transformers' DeepSeek-V3 adds no balance loss)."""
  setup, params = model
  ref = reference(ARCH)
  tokens, logits = ref["tokens_2"], ref["logits_2"].astype(np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
  want = -np.mean(logp[np.arange(tokens.size - 1), tokens[1:]])
  batch = {"inputs": jnp.asarray(tokens[None, :-1]), "targets": jnp.asarray(tokens[None, 1:])}
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    loss, _ = jax.jit(lambda p, b: setup.model(p).loss_and_metrics(b))(params, batch)
  assert float(loss) == pytest.approx(want, abs=1e-5)


def test_export_is_bit_exact_and_config_round_trips(model, tmp_path):
  """The imported params written back: the source's tensors bit for bit (the selection bias
  as e_score_correction_bias) and a config.json with every key of the source's."""
  setup, params = model
  src = os.path.join(FIXTURES, ARCH)
  assert not setup.exp.model.tied_embedding
  assert_export_bit_exact(params, setup.exp.model, ARCH, src, tmp_path)
  assert_config_round_trips(deepseek_v3, setup.exp.model, ARCH, src)


@pytest.mark.parametrize("changes, message", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method='bitsandbytes'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size"),
    ({"qk_head_dim": 20}, "qk_head_dim=20"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  assert_config_refused(tmp_path, message, ARCH, **changes)


def fp8_checkpoint(src: str, out: str, block=(16, 16)) -> dict:
  """The fixture as DeepSeek-V3 publishes its weights: every linear projection's weight in
  float8_e4m3fn beside its per-block inverse scales (amax / 448 per block); returns the
  dequantized float32 of each quantized tensor (W8 x its block's scale)."""
  import json
  import shutil
  import ml_dtypes
  r = safetensors.Reader(src)
  tensors, want = {}, {}
  for name in r.names():
    t = r.get(name)
    tensors[name] = t
    if not (name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")):
      continue
    m, n = t.shape
    mb, nb = -(-m // block[0]), -(-n // block[1])
    padded = np.zeros((mb * block[0], nb * block[1]), np.float32)
    padded[:m, :n] = np.abs(t)
    amax = padded.reshape(mb, block[0], nb, block[1]).max(axis=(1, 3))
    scale = np.maximum(amax, 1e-12).astype(np.float32) / 448.0
    full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:m, :n]
    w8 = (t / full).astype(ml_dtypes.float8_e4m3fn)
    tensors[name], tensors[name + "_scale_inv"] = w8, scale
    want[name] = w8.astype(np.float32) * full
  os.makedirs(out, exist_ok=True)
  safetensors.write_model(out, [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__, 1 << 30)
  cfg = hf_models.read(src)
  cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": list(block)}
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f)
  shutil.copy(os.path.join(src, "tokenizer.json"), out)
  return want


def test_fp8_block_scaled_checkpoint_imports_dequantized(tmp_path):
  """Blocks of 16 x 16 (ragged at the 24- and 28-row edges): every quantized tensor comes in as
  its fp8 values times its block's scale, bit for bit (read back through an export), the rest
  as stored; the scales themselves are no params (the walk never sees them)."""
  src = os.path.join(FIXTURES, ARCH)
  d = str(tmp_path / "fp8")
  want = fp8_checkpoint(src, d)
  assert len(want) == 3 * 5 + 3 + 2 * 8 * 3 + 2 * 3   # attention x 3 layers, dense MLP, experts, shared
  setup, params = _imported_from(configs.get(f"hf:{d}"), d)
  assert_export_dequantized(params, setup.exp.model, ARCH, src, tmp_path / "out", want)
