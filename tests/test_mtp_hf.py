"""DeepSeek-V3 checkpoints with their multi-token prediction layer (models/hf/deepseek_v3.py).

Fixture `deepseek_v3_mtp` (tests/fixtures/make_hf_fixtures.py, transformers 5.23): 3 layers as
transformers saved them plus MTP layer 3 as DeepSeek publishes it (a whole MLA + MoE decoder
layer, enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head), which
transformers neither builds nor reads: its recorded logits are the main model's. The import reads
the layer into model.mtp, the main logits and greedy tokens stay transformers', the training loss
is transformers' cross entropy plus lambda x the MTP loss, and export writes every tensor back bit
for bit (the MTP layer's copies as the main embedding and head).
"""

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hf_helpers import (FIXTURES, assert_config_round_trips, assert_export_bit_exact,  # noqa: E402
                        assert_export_dequantized, assert_logits_match, experiment, imported,
                        imported_from, reference, train_loss)

from shardax.configs.mtp import MTPConfig  # noqa: E402
from shardax.configs.schema import ConfigError  # noqa: E402
from shardax.models.hf import deepseek_v3  # noqa: E402
from shardax.trainer import decode  # noqa: E402
from shardax.trainer.hf import safetensors  # noqa: E402

ARCH, HF_ARCH = "deepseek_v3_mtp", "deepseek_v3"
SOURCE = os.path.join(FIXTURES, ARCH)
MTP = "model.layers.3."


@pytest.fixture(scope="module")
def model():
  return imported(ARCH)


def test_the_mtp_layer_is_read_into_model_mtp(model):
  setup, params = model
  assert setup.exp.model.mtp == MTPConfig(depth=1, loss_weight=0.1)
  r = safetensors.Reader(SOURCE)
  mtp = params["mtp"][0]
  # eh_proj [hidden, 2 hidden]: its input columns are the embedding's, then the hidden state's
  np.testing.assert_array_equal(np.asarray(mtp["eh_proj"]["kernel"]).reshape(128, 64).T, r.get(MTP + "eh_proj.weight"))
  np.testing.assert_array_equal(np.asarray(mtp["head_norm"]["scale"]), r.get(MTP + "shared_head.norm.weight"))
  np.testing.assert_array_equal(np.asarray(mtp["block"]["moe"]["wi_gate"])[5],
                                r.get(MTP + "mlp.experts.5.gate_proj.weight").T)
  # transformers' own save of a DeepSeek-V3 (num_nextn_predict_layers 1, no MTP tensors): no MTP
  assert hf_fixture_mtp("deepseek_v3") is None


def test_expert_parallel_import_reads_the_same_mtp_layer(model):
  """On (4, 2) with the 'expert' rules the MTP block's experts split over data like the stack's,
  and every MTP param is the one-device import's, bit for bit."""
  _, params = model
  _, sharded = imported(ARCH, (4, 2), "sharding.preset='expert'")
  assert sharded["mtp"][0]["block"]["moe"]["wi_gate"].sharding.spec[0] == "data"
  for a, b in zip(jax.tree.leaves(sharded["mtp"]), jax.tree.leaves(params["mtp"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def hf_fixture_mtp(arch):
  return experiment(arch).model.mtp


def test_main_logits_and_greedy_tokens_are_transformers(model):
  setup, params = model
  assert_logits_match(setup, params, ARCH)
  ref = reference(ARCH)
  gen = decode.Generator(setup.exp.model, params, setup.mesh, setup.rules)
  result = gen.run([ref["prompt"].tolist()], decode.Sampling(max_new_tokens=ref["greedy"].size))
  assert result.ids[0][:result.counts[0]].tolist() == ref["greedy"].tolist()


def test_training_loss_is_transformers_cross_entropy_plus_lambda_mtp(model):
  setup, params = model
  ref = reference(ARCH)
  loss, metrics = train_loss(setup, params, ref["train_tokens"])
  assert metrics["ce_loss"] == pytest.approx(float(ref["train_ce"]), abs=1e-5)
  assert metrics["mtp/loss_1"] > 1.0   # the module's own prediction, not a zero term
  assert loss == pytest.approx(metrics["ce_loss"] + 0.1 * metrics["mtp/loss_1"], rel=1e-6)


def test_export_writes_the_mtp_layer_back_bit_exact(model, tmp_path):
  setup, params = model
  names = assert_export_bit_exact(params, setup.exp.model, HF_ARCH, SOURCE, tmp_path)
  assert {MTP + n for n in ("eh_proj.weight", "embed_tokens.weight", "shared_head.head.weight",
                            "mlp.experts.7.down_proj.weight", "self_attn.kv_b_proj.weight")} <= set(names)
  out = assert_config_round_trips(deepseek_v3, setup.exp.model, HF_ARCH, SOURCE)
  assert out["num_nextn_predict_layers"] == 1


def test_an_fp8_block_scaled_checkpoint_brings_its_mtp_layer_dequantized(tmp_path):
  """As DeepSeek-V3 publishes it: every projection in fp8 with per-block inverse scales, the MTP
  layer's eh_proj and block included; it imports dequantized and exports as the dequantized
  values, the copies of the embedding and head as they are."""
  from test_hf_deepseek_v3 import fp8_checkpoint
  d = str(tmp_path / "fp8")
  want = fp8_checkpoint(SOURCE, d)
  assert MTP + "eh_proj.weight" in want and MTP + "mlp.experts.3.up_proj.weight" in want
  setup, params = _import(d)
  assert_export_dequantized(params, setup.exp.model, HF_ARCH, SOURCE, tmp_path / "out", want)


def rewritten(tmp_path, change):
  """The fixture with its tensors passed through `change` (a dict edited in place)."""
  r = safetensors.Reader(SOURCE)
  tensors = {n: r.get(n) for n in r.names()}
  change(tensors)
  d = str(tmp_path / "ckpt")
  os.makedirs(d)
  safetensors.write_model(d, [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__, 1 << 30)
  for name in ("config.json", "tokenizer.json"):
    shutil.copy(os.path.join(SOURCE, name), d)
  return d


def _import(d):
  from shardax import configs
  cfg = configs.get(f"hf:{d}")
  configs.apply_overrides(cfg, ["mesh.ici=(1, 1)"])
  return imported_from(configs.build(cfg), d)


def test_an_mtp_copy_of_the_head_that_differs_is_refused(tmp_path):
  def change(t):
    t[MTP + "shared_head.head.weight"] = t[MTP + "shared_head.head.weight"].copy()
    t[MTP + "shared_head.head.weight"][7, 3] += 1.0
  with pytest.raises(ConfigError, match=r"model\.layers\.3\.shared_head\.head\.weight differs from lm_head\.weight"):
    _import(rewritten(tmp_path, change))


def test_an_mtp_layer_missing_a_tensor_is_refused(tmp_path):
  with pytest.raises(ConfigError, match=r"lacks 1 tensor.*model\.layers\.3\.eh_proj\.weight"):
    _import(rewritten(tmp_path, lambda t: t.pop(MTP + "eh_proj.weight")))


def test_num_mtp_layers_is_the_alias_and_must_agree():
  base = json.load(open(os.path.join(SOURCE, "config.json")))
  assert deepseek_v3.mtp_config({**base, "num_nextn_predict_layers": 2}) == MTPConfig(2, 0.1)
  alias = {k: v for k, v in base.items() if k != "num_nextn_predict_layers"}
  assert deepseek_v3.mtp_config({**alias, "num_mtp_layers": 1}) == MTPConfig(1, 0.1)
  assert deepseek_v3.mtp_config({**base, "num_nextn_predict_layers": 0}) is None
  with pytest.raises(ConfigError, match="num_mtp_layers=2 .its alias. disagree"):
    deepseek_v3.mtp_config({**base, "num_mtp_layers": 2})
