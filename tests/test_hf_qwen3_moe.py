"""Qwen3-MoE from Hugging Face, checked against transformers' recorded outputs, and the
param walk of every layout of the MoE stack (first dense layers, units of dense + MoE blocks).

Fixtures (tests/fixtures/make_hf_fixtures.py, transformers 5.23): `qwen3_moe` (4 layers, layer
0 dense by mlp_only_layers, top-2 of 8 renormalized) and `qwen3_moe_sparse` (6 layers,
decoder_sparse_step 2 with mlp_only_layers [1]: layers 0-1 dense, then dense + MoE units; raw
softmax gates, tied, attention biases), each with logits, greedy tokens and a training loss.
"""

import json
import os

import jax
import numpy as np
import pytest

from shardax import configs
from shardax.configs.schema import ConfigError
from shardax.models import hf as hf_models
from shardax.models.hf import qwen3_moe
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import model_setup
from shardax.trainer.hf import exporter, importer, safetensors
from hf_helpers import (FIXTURES, assert_config_refused, assert_config_round_trips, assert_export_bit_exact,
                        assert_greedy_matches, assert_logits_match, assert_same_tensors, experiment, imported,
                        reference, through_checkpoint, train_loss)

ARCHS = ("qwen3_moe", "qwen3_moe_sparse")


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
  setup, params = imported(request.param)
  return request.param, setup, params


def test_config_maps_onto_the_moe_lm():
  """mlp_only_layers / decoder_sparse_step -> first_dense_layers / every; norm_topk_prob ->
  renormalize; the two intermediate sizes; the balance-loss weight times k."""
  t = experiment("qwen3_moe").model
  m = t.moe
  assert (m.num_experts, m.top_k, m.d_ff, m.every, m.first_dense_layers, m.renormalize, m.dispatch) == \
      (8, 2, 32, 1, 1, True, "dropless")
  assert (t.d_ff, t.head_dim, t.qk_norm, t.qkv_bias, t.tied_embedding, t.rope_theta) == (96, 24, True, False, False, 1e6)
  assert m.aux_loss_weight == pytest.approx(0.05 * 2) and m.num_shared_experts == 0
  t = experiment("qwen3_moe_sparse").model
  m = t.moe
  assert (m.num_experts, m.d_ff, m.every, m.first_dense_layers, m.renormalize) == (4, 48, 2, 2, False)
  assert (t.qkv_bias, t.out_bias, t.tied_embedding) == (True, True, True)


def test_logits_match_transformers(arch_model):
  arch, setup, params = arch_model
  assert_logits_match(setup, params, arch, show=True)


def test_unscanned_stack_matches_transformers_too():
  """scan_layers=False: layers/first_dense/{i}, layers/blocks/{u}/dense/{j}, .../moe_block."""
  setup, params = imported("qwen3_moe_sparse", (1, 1), "model.scan_layers=False")
  assert params["layers"]["blocks"][1]["moe_block"]["moe"]["wo"].shape == (4, 48, 64)
  assert_logits_match(setup, params, "qwen3_moe_sparse")


def test_greedy_decode_matches_transformers(arch_model):
  arch, setup, params = arch_model
  assert_greedy_matches(setup, params, arch)


def _loss(setup, params, tokens):
  """(loss, cross entropy, balance loss as transformers weighs it: moe/aux_loss x k) of
  transformers' training batch `tokens` (hf_helpers.train_batch)."""
  loss, metrics = train_loss(setup, params, tokens)
  return loss, metrics["ce_loss"], metrics["moe/aux_loss"] * setup.exp.model.moe.top_k


def test_training_loss_matches_transformers(arch_model):
  """shardax's loss_and_metrics on transformers' training batch equals transformers' loss
  with output_router_logits (cross entropy + router_aux_loss_coef x its balance loss, the
  expert shares pooled over the MoE layers), its cross entropy and its balance loss."""
  arch, setup, params = arch_model
  ref = reference(arch)
  loss, ce, balance = _loss(setup, params, ref["train_tokens"])
  print(f"{arch}: loss {loss:.6f}, transformers' {float(ref['train_loss']):.6f}")
  assert ce == pytest.approx(float(ref["train_ce"]), abs=1e-5)
  assert balance == pytest.approx(float(ref["train_aux"]), abs=1e-5)
  assert loss == pytest.approx(float(ref["train_loss"]), abs=1e-5)


def test_training_loss_on_an_expert_parallel_mesh():
  """The same loss with the experts split 4 ways and the batch 2 ways ((4, 2) mesh, 'expert'
  rules): the pooled shares are of the whole batch. The batch is transformers' twice (its
  rows repeated: the same means)."""
  setup, params = imported("qwen3_moe", (4, 2), "sharding.preset='expert'")
  ref = reference("qwen3_moe")
  loss, ce, balance = _loss(setup, params, np.concatenate([ref["train_tokens"]] * 2))
  assert (ce, balance, loss) == pytest.approx(
      (float(ref["train_ce"]), float(ref["train_aux"]), float(ref["train_loss"])), abs=1e-5)


def test_per_layer_balance_loss_is_the_mean_of_each_layers():
  """aux_loss_pooling='per_layer': the balance loss is transformers' balance function of each
  MoE layer's router logits alone, averaged over the layers (which differs from the pooled
  one by more than the tolerance here)."""
  setup, params = imported("qwen3_moe", (1, 1), "model.moe.aux_loss_pooling='per_layer'")
  ref = reference("qwen3_moe")
  _, _, balance = _loss(setup, params, ref["train_tokens"])
  assert balance == pytest.approx(float(np.mean(ref["train_aux_layers"])), abs=1e-5)
  assert abs(float(np.mean(ref["train_aux_layers"])) - float(ref["train_aux"])) > 1e-2


def test_export_is_bit_exact_and_config_round_trips(arch_model, tmp_path):
  """The imported params written back: the source's tensors bit for bit (the tied head
  left out) and a config.json with every key of the source's."""
  arch, setup, params = arch_model
  src = os.path.join(FIXTURES, arch)
  assert_export_bit_exact(params, setup.exp.model, "qwen3_moe", src, tmp_path)
  assert_config_round_trips(qwen3_moe, setup.exp.model, "qwen3_moe", src)


@pytest.mark.slow   # a train-state checkpoint saved and restored on 8 devices: ~35 s on 2 busy cores
def test_checkpoint_round_trip_with_experts_split(tmp_path):
  """qwen3_moe_sparse through a step-0 checkpoint on a (4, 2) mesh with the 'expert' rules
  (each device one expert of every MoE layer) and back out: the same tensors bit for bit,
  and the config.json transformers reads (make_hf_fixtures.py --check-export OUT
  qwen3_moe_sparse loads such an export with no missing or unexpected tensor)."""
  src = os.path.join(FIXTURES, "qwen3_moe_sparse")
  out = through_checkpoint(experiment("qwen3_moe_sparse", "mesh.ici=(4, 2)", "sharding.preset='expert'"), tmp_path)
  assert "model.layers.5.mlp.experts.3.down_proj.weight" in assert_same_tensors(src, out)
  assert hf_models.read(out)["mlp_only_layers"] == [1]


# Per Hugging Face layer of a 5-layer stack (first_dense_layers 1, every 2): where its block is.
SCANNED = {0: ("first_dense", 0), 1: ("blocks/dense/0", 0), 2: ("blocks/moe_block", 0),
           3: ("blocks/dense/0", 1), 4: ("blocks/moe_block", 1)}
UNSCANNED = {0: "first_dense/0", 1: "blocks/0/dense/0", 2: "blocks/0/moe_block", 3: "blocks/1/dense/0",
             4: "blocks/1/moe_block"}


def _get(tree, path):
  for part in path.split("/"):
    tree = tree[int(part)] if part.isdigit() else tree[part]
  return tree


@pytest.mark.parametrize("scan", [True, False])
def test_walk_maps_first_dense_layers_and_units_of_every_2(tmp_path, scan):
  """A 5-layer MoE LM with first_dense_layers=1 and moe.every=2 (layer 0 dense, then units of
  a dense and an MoE layer: MoE layers 2 and 4), random params: exported, each layer's
  tensors come from that layer's block (SCANNED / UNSCANNED), the experts only from layers 2
  and 4; imported back, every leaf equal."""
  exp = experiment("qwen3_moe", "model.num_layers=5", "model.moe.every=2", "model.moe.first_dense_layers=1",
                   f"model.scan_layers={scan}", "mesh.ici=(1, 1)")
  setup = model_setup.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), setup.abstract_params)
  out = str(tmp_path)
  exporter.export_params(params, exp.model, "qwen3_moe", out, np.float32, 1 << 30)
  with open(os.path.join(out, "config.json"), "w") as f:   # the importer reads the architecture from it
    json.dump({"architectures": ["Qwen3MoeForCausalLM"]}, f)
  r = safetensors.Reader(out)
  experts = sorted({int(n.split(".")[2]) for n in r.names() if ".mlp.experts." in n})
  dense = sorted({int(n.split(".")[2]) for n in r.names() if ".mlp.gate_proj." in n})
  assert (experts, dense) == ([2, 4], [0, 1, 3])
  for i in range(5):
    where = UNSCANNED[i] if not scan else SCANNED[i][0]
    block = _get(params["layers"], where)
    scale = block["attn_norm"]["scale"] if not scan else block["attn_norm"]["scale"][SCANNED[i][1]]
    np.testing.assert_array_equal(r.get(f"model.layers.{i}.input_layernorm.weight"), scale, err_msg=f"layer {i}")
  wo = _get(params["layers"], "blocks/moe_block/moe/wo" if scan else "blocks/1/moe_block/moe/wo")
  wo = wo[1] if scan else wo
  np.testing.assert_array_equal(r.get("model.layers.4.mlp.experts.3.down_proj.weight"), wo[3].T)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    back = importer.import_params(setup, out)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(back)):
    np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("changes, message", [
    ({"some_new_routing": 2.0}, "some_new_routing"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers"),          # a dense layer between MoE layers
    ({"decoder_sparse_step": 3}, "decoder_sparse_step=3"),   # 4 layers are not units of 3
    ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ({"num_experts": 16}, "disagree"),                       # beside num_local_experts 8
    ({"num_local_experts": 0}, "dense Qwen3"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  assert_config_refused(tmp_path, message, "qwen3_moe", **changes)


def test_export_refuses_what_qwen3_moe_cannot_express():
  model = experiment("qwen3_moe").model
  import dataclasses
  moe = dataclasses.replace(model.moe, every=2, first_dense_layers=1)
  with pytest.raises(ConfigError, match="first_dense_layers=1 not a multiple"):
    qwen3_moe.check_exportable(dataclasses.replace(model, num_layers=5, moe=moe), "qwen3_moe")
  moe = dataclasses.replace(model.moe, num_shared_experts=1)
  with pytest.raises(ConfigError, match="num_shared_experts=1"):
    qwen3_moe.check_exportable(dataclasses.replace(model, moe=moe), "qwen3_moe")


# Qwen/Qwen3-235B-A22B's config.json as published (transformers 4.51 spelling: num_experts, rope_theta).
PUBLISHED_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 94, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 64, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def test_published_235b_config_is_the_registered_shape(tmp_path):
  """The published config.json imports as configs/shapes.py QWEN3_235B (what moe.qwen3_235b
  dry-runs): 235.09B parameters; its export writes the hub's spelling back."""
  from shardax.configs import shapes
  d = tmp_path / "m"
  d.mkdir()
  (d / "config.json").write_text(json.dumps(PUBLISHED_235B))
  got, want = configs.build(configs.get(f"hf:{d}")).model, shapes.QWEN3_235B
  fields = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "d_ff", "vocab_size", "rope_theta",
            "qk_norm", "tied_embedding", "norm_eps", "qkv_bias")
  assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
  moe = ("num_experts", "top_k", "d_ff", "every", "first_dense_layers", "renormalize", "score",
         "num_shared_experts", "aux_loss_weight")
  assert {f: getattr(got.moe, f) for f in moe} == {f: getattr(want.moe, f) for f in moe}
  assert round(got.param_count() / 1e9, 2) == 235.09
  out = qwen3_moe.to_hf(got, "qwen3_moe", PUBLISHED_235B)
  assert (out["num_experts"], out["mlp_only_layers"], out["max_position_embeddings"]) == (128, [], 40960)
