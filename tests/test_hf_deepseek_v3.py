"""DeepSeek-V3 from Hugging Face (models/hf/deepseek_v3.py), checked against transformers' recorded
outputs: multi-head latent attention (q LoRA, interleaved RoPE, YaRN with its mscale), the
group-limited sigmoid router with its selection bias, shared experts, a first dense layer.

Fixture (tests/fixtures/make_hf_fixtures.py, transformers 5.23): `deepseek_v3`, 3 layers, layer 0
dense, top-2 of 8 experts in 2 of 4 groups; logits of three sequences, greedy tokens of a
prompt and of three longer ones.
"""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_hf import FIXTURES, _write_config, experiment, imported, logits_of, reference  # noqa: E402

from shardax import configs  # noqa: E402
from shardax.configs.schema import ConfigError  # noqa: E402
from shardax.models import hf as hf_models  # noqa: E402
from shardax.models.hf import deepseek_v3  # noqa: E402
from shardax.sharding import use_rules  # noqa: E402
from shardax.trainer import decode  # noqa: E402
from shardax.trainer.hf import exporter, safetensors  # noqa: E402

ARCH = "deepseek_v3"


@pytest.fixture(scope="module")
def model():
  return imported(ARCH)


def test_config_maps_onto_mla_and_the_group_limited_moe():
  t = experiment(ARCH).model
  a, m = t.mla, t.moe
  assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
          a.rope_interleave) == (24, 16, 16, 8, 12, True)
  assert (t.rope_scaling, t.rope_scaling_factor, t.rope_original_max_len, t.rope_mscale,
          t.rope_mscale_all_dim) == ("yarn", 4.0, 16, 1.0, 0.5)
  assert (m.num_experts, m.top_k, m.n_group, m.topk_group, m.d_ff, m.num_shared_experts,
          m.first_dense_layers, m.score, m.gate_scale, m.renormalize) == (8, 2, 4, 2, 32, 1, 1, "sigmoid", 2.5, True)
  assert m.bias_update_rate > 0 and m.aux_loss_weight == 0


def assert_logits_match(setup, params, atol=1e-4):
  ref = reference(ARCH)
  for j, got in enumerate(logits_of(setup, params, ref)):
    np.testing.assert_allclose(got, ref[f"logits_{j}"], atol=atol, rtol=0, err_msg=f"sequence {j}")


def test_logits_match_transformers(model):
  assert_logits_match(*model)


def test_unscanned_stack_matches_transformers_too():
  setup, params = imported(ARCH, (1, 1), "model.scan_layers=False")
  assert params["layers"]["blocks"][1]["moe_block"]["attn"]["kv_up"]["kernel"].shape == (16, 4, 16 + 12)
  assert_logits_match(setup, params)


@pytest.mark.parametrize("feature", ["group limit", "interleaved RoPE", "softmax mscale"])
def test_each_feature_of_the_fixture_changes_its_logits(feature):
  """The fixture exercises the group limit, the interleaved RoPE and YaRN's softmax mscale: any
  of them switched off moves the logits well past the tolerance."""
  cfg = configs.get(f"hf:{os.path.join(FIXTURES, ARCH)}")
  if feature == "group limit":
    cfg.model.moe.n_group, cfg.model.moe.topk_group = 1, 1
  elif feature == "interleaved RoPE":   # the adapter's MLAConfig is a value in the tree
    cfg.model.mla = dataclasses.replace(cfg.model.mla, rope_interleave=False)
  else:
    cfg.model.rope_mscale_all_dim = 0.0
  setup, params = _imported_from(cfg)
  ref = reference(ARCH)
  worst = max(float(np.abs(g - ref[f"logits_{j}"]).max()) for j, g in enumerate(logits_of(setup, params, ref)))
  assert worst > 1e-2, (feature, worst)


def _imported_from(cfg):
  from shardax.sharding import make_mesh
  from shardax.trainer import state as state_lib
  from shardax.trainer.hf import importer
  configs.apply_overrides(cfg, ["mesh.ici=(1, 1)"])
  exp = configs.build(cfg)
  setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    return setup, importer.import_params(setup, os.path.join(FIXTURES, ARCH))


def test_greedy_decode_over_the_latent_cache_matches_transformers(model):
  setup, params = model
  ref = reference(ARCH)
  gen = decode.Generator(setup.exp.model, params, setup.mesh, setup.rules)
  result = gen.run([ref["prompt"].tolist()], decode.Sampling(max_new_tokens=ref["greedy"].size))
  assert result.ids[0][:result.counts[0]].tolist() == ref["greedy"].tolist()
  prompts = [ref[f"prompt_{j}"].tolist() for j in range(3)]
  result = gen.run(prompts, decode.Sampling(max_new_tokens=ref["greedy_0"].size))
  for j in range(3):
    assert result.ids[j][:result.counts[j]].tolist() == ref[f"greedy_{j}"].tolist(), f"prompt {j}"


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
  exporter.export_params(params, setup.exp.model, ARCH, str(tmp_path), np.float32, 1 << 30)
  a, b = safetensors.Reader(src), safetensors.Reader(str(tmp_path))
  assert a.names() == b.names()
  for name in b.names():
    assert a.get(name).tobytes() == b.get(name).tobytes(), name
  src_cfg = hf_models.read(src)
  deepseek_v3.check_exportable(setup.exp.model, ARCH)
  out = deepseek_v3.to_hf(setup.exp.model, ARCH, src_cfg)
  assert {k: out.get(k) for k in src_cfg} == src_cfg
  assert deepseek_v3.model_fields(out) == deepseek_v3.model_fields(src_cfg)
  assert deepseek_v3.moe_fields(out) == deepseek_v3.moe_fields(src_cfg)


@pytest.mark.parametrize("changes, message", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"qk_head_dim": 20}, "qk_head_dim=20"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  d = _write_config(str(tmp_path), ARCH, **changes)
  with pytest.raises(ConfigError, match=message):
    configs.get(f"hf:{d}")
