"""Hugging Face checkpoints in and out, checked against transformers' recorded outputs.

The fixtures (tests/fixtures/hf/, written by tests/fixtures/make_hf_fixtures.py in its own
torch environment) hold small random-weight models of each architecture as transformers
saved them, with the logits and greedy tokens transformers computed. No torch here.
"""

import dataclasses
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError
from shardax.sharding import make_mesh, use_rules
from shardax.sharding import rules as rules_lib
from shardax.trainer import checkpoint as ckpt_lib
from shardax.trainer import decode, model_setup
from shardax.trainer import state as state_lib
from shardax.trainer.data import packing, tokenizers
from shardax.models import hf as hf_models
from shardax.models.hf import llama as hf_llama
from shardax.trainer.hf import exporter, importer, safetensors
from hf_helpers import (FIXTURES, assert_config_refused, assert_export_bit_exact, assert_logits_match,
                        assert_same_tensors, experiment, imported, reference, through_checkpoint,
                        write_config)

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "mistral_window", "mixtral_llama3")


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
  setup, params = imported(request.param)
  return request.param, setup, params


def test_logits_match_transformers(arch_model, request):
  arch, setup, params = arch_model
  assert_logits_match(setup, params, arch, show=True)   # prints docs/huggingface.md's figure (pytest -s)


def test_greedy_decode_matches_transformers(arch_model, request):
  arch, setup, params = arch_model
  ref = reference(arch)
  gen = decode.Generator(setup.exp.model, params, setup.mesh, setup.rules)
  result = gen.run([ref["prompt"].tolist()], decode.Sampling(max_new_tokens=ref["greedy"].size))
  assert result.ids[0][:result.counts[0]].tolist() == ref["greedy"].tolist()
  # The windowed cases' prompts outrun the sliding window (one batch, cached decode).
  long = [ref[f"prompt_{j}"].tolist() for j in range(3) if f"prompt_{j}" in ref]
  if long:
    result = gen.run(long, decode.Sampling(max_new_tokens=ref["greedy_0"].size))
    same = sum(int((result.ids[j] == ref[f"greedy_{j}"]).sum()) for j in range(len(long)))
    assert same == sum(ref[f"greedy_{j}"].size for j in range(len(long))), \
        f"{arch}: {same} of {3 * ref['greedy_0'].size} greedy tokens equal transformers'"


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_same_logits_on_2x4_mesh_with_2d_rules(arch):
  # The 2d rules, but 2 kv heads cannot split 4 ways: they stay whole (jit arguments split evenly).
  rules = tuple(r for r in rules_lib.PRESETS["2d"] if r[0] != "kv_heads")
  setup, params = imported(arch, (2, 4), f"sharding.rules={rules!r}")
  assert setup.mesh.shape == {"data": 2, "model": 4}
  assert params["layers"]["blocks"]["attn"]["query"]["kernel"].sharding.spec[1:3] == ("data", "model")
  assert_logits_match(setup, params, arch, rows=4)


def test_import_export_round_trip_is_bit_exact(tmp_path):
  """llama3 (sharded input, tied, biases) through a step-0 checkpoint on an fsdp (8, 1) mesh
  and back; the export is split into several files by a small shard size."""
  src = os.path.join(FIXTURES, "llama3")
  exp = experiment("llama3", "mesh.ici=(8, 1)", "sharding.preset='fsdp'")
  job = str(tmp_path / "job")
  importer.run(exp, job)
  with pytest.raises(ConfigError, match="fresh --job_dir"):
    importer.run(exp, job)
  # Export (like eval and decode) reads the params only, never the Adam moments beside them,
  # and builds no optimizer: it runs from an experiment with no optimizer section.
  exp = dataclasses.replace(exp, optimizer=None)
  setup = model_setup.create(exp, make_mesh(exp.mesh))
  params, step = ckpt_lib.restore_params(setup, job)
  assert step == 0 and jax.tree.structure(params) == jax.tree.structure(setup.abstract_params)
  out = str(tmp_path / "out")
  summary = exporter.run(exp, job, out, max_shard_bytes=100_000)
  assert summary["step"] == 0 and safetensors.INDEX in summary["files"] and len(summary["files"]) > 2
  assert_same_tensors(src, out)
  src_cfg, out_cfg = hf_models.read(src), hf_models.read(out)
  assert hf_llama.model_fields(src_cfg) == hf_llama.model_fields(out_cfg)
  assert out_cfg["max_position_embeddings"] == src_cfg["max_position_embeddings"]
  assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_mixtral_round_trip_with_experts_split_is_bit_exact(tmp_path):
  """Mixtral through a step-0 checkpoint with the experts split 4 ways (the 'expert' rules
  on a (4, 2) mesh: each device holds one expert of every layer, so the importer fills
  [layer, expert] blocks) and back: the same tensors bit for bit, and a config.json with
  every key of the source's (transformers reads it as the same model: the fixture script's
  --check-export loads such an export in transformers, no missing or unexpected keys)."""
  src = os.path.join(FIXTURES, "mixtral")
  out = through_checkpoint(experiment("mixtral", "mesh.ici=(4, 2)", "sharding.preset='expert'"), tmp_path)
  assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in assert_same_tensors(src, out)
  src_cfg, out_cfg = hf_models.read(src), hf_models.read(out)
  assert {k: out_cfg.get(k) for k in src_cfg} == src_cfg


def test_export_of_every_architecture_is_bit_exact(arch_model, tmp_path):
  """The imported params written back (no checkpoint in between): the same tensors, bit for
  bit, and a config.json that maps to the same model."""
  arch, setup, params = arch_model
  src = os.path.join(FIXTURES, arch)
  src_cfg = hf_models.read(src)
  arch_name = hf_models.architecture(src_cfg)
  assert_export_bit_exact(params, setup.exp.model, arch_name, src, tmp_path)
  adapter = hf_models.adapter_for(src_cfg)
  written = adapter.to_hf(setup.exp.model, arch_name, src_cfg)
  assert adapter.model_fields(written) == adapter.model_fields(src_cfg)
  assert adapter.moe_fields(written) == adapter.moe_fields(src_cfg)


def test_tokenizer_encodes_like_transformers():
  cases = json.load(open(os.path.join(FIXTURES, "tokenizer_cases.json")))["cases"]
  tok = tokenizers.from_spec("hf_model:" + os.path.join(FIXTURES, "llama", "tokenizer.json"))
  assert tok.own_start
  for case in cases:
    assert tok.encode(case["text"]) == case["ids"], case["text"]
  # The experiment encodes with it; documents start with the model's BOS, end with its eos.
  assert experiment("llama").data.tokenizer.startswith(tokenizers.HF_MODEL_PREFIX)
  ex = packing.document_example(np.asarray(cases[0]["ids"]), eos=tok.eos_id, own_start=True)
  assert ex["inputs"].tolist() == cases[0]["ids"]
  assert ex["targets"].tolist() == cases[0]["ids"][1:] + [tok.eos_id]


@pytest.mark.parametrize("changes, message", [
    ({"some_new_scaling": 2.0}, "some_new_scaling"),
    ({"num_local_experts": 8}, "num_local_experts"),   # a router key in a dense model's config
    ({"base": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"base": "mixtral", "mlp_bias": True}, "mlp_bias"),
    ({"architectures": ["GPT2LMHeadModel"]}, "exactly one of"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}, "'longrope' is not implemented"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "sliding-window"),
])
def test_config_keys_we_do_not_implement_are_errors(tmp_path, changes, message):
  assert_config_refused(tmp_path, message, **changes)


def test_mixtral_config_maps_onto_the_moe_lm():
  """Router keys -> MoEConfig: top-k renormalized softmax gates, dropless; the balance-loss
  coefficient times k (transformers sums its loss over the k slots); and back."""
  exp = experiment("mixtral")
  t, m = exp.model, exp.model.moe
  assert (m.num_experts, m.top_k, m.d_ff, m.every, m.score, m.renormalize, m.dispatch) == \
      (4, 2, 96, 1, "softmax", True, "dropless")
  assert m.aux_loss_weight == pytest.approx(0.02 * 2) and (t.num_kv_heads, t.rope_theta) == (2, 1e6)
  src = hf_models.read(os.path.join(FIXTURES, "mixtral"))
  out = hf_llama.to_hf(exp.model, "mixtral", src)
  assert {k: out.get(k) for k in src} == src
  with pytest.raises(ConfigError, match="model.moe.every=2"):
    hf_llama.check_exportable(dataclasses.replace(exp.model, moe=dataclasses.replace(m, every=2)), "mixtral")
  with pytest.raises(ConfigError, match="mixture of experts"):
    hf_llama.check_exportable(exp.model, "mistral")


def test_mixtral_unscanned_stack_maps_too(tmp_path):
  """scan_layers=False: one [E, ...] leaf per layer (layers/blocks/{i}/moe_block/...), same tensors."""
  setup, params = imported("mixtral", (1, 1), "model.scan_layers=False")
  assert params["layers"]["blocks"][1]["moe_block"]["moe"]["wo"].shape == (4, 96, 64)
  assert not setup.exp.model.tied_embedding
  assert_export_bit_exact(params, setup.exp.model, "mixtral", os.path.join(FIXTURES, "mixtral"), tmp_path)


def test_mixtral_moe_layer_computes_transformers_routing():
  """Layer 1's imported MoE FFN against transformers' MixtralSparseMoeBlock math written out
  from the raw checkpoint tensors: softmax of gate.weight @ x over all experts, the top 2,
  renormalized, sum of gate * w2(silu(w1 x) * w3 x). Checks the router/expert mapping (w1
  vs w3, expert order, transposes) while the whole model's logits wait for the layer fix."""
  from flax import nnx
  setup, params = imported("mixtral")
  moe = setup.model(params).layers.blocks.moe_block.moe
  graphdef, state = nnx.split(moe)
  layer1 = nnx.merge(graphdef, jax.tree.map(lambda a: a[1], state))
  x = np.random.default_rng(0).standard_normal((2, 9, 64)).astype(np.float32)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    got = np.asarray(jax.jit(lambda v: layer1(v)[0])(jnp.asarray(x)))
  w = safetensors.Reader(os.path.join(FIXTURES, "mixtral"))
  p = "model.layers.1.block_sparse_moe."
  logits = x @ w.get(p + "gate.weight").T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, -1)[..., :2]
  gates = np.take_along_axis(probs, top, -1)
  gates /= gates.sum(-1, keepdims=True)
  want = np.zeros_like(x)
  for idx in np.ndindex(x.shape[:2]):
    for e, g in zip(top[idx], gates[idx]):
      h = x[idx] @ w.get(p + f"experts.{e}.w1.weight").T
      h = h / (1 + np.exp(-h)) * (x[idx] @ w.get(p + f"experts.{e}.w3.weight").T)
      want[idx] += g * (h @ w.get(p + f"experts.{e}.w2.weight").T)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_export_keeps_the_source_length_and_window(tmp_path):
  """The experiment caps model.max_len at 4096 for training; the exported config.json still
  declares the source's length, and a context extended past it is written as trained. The
  sliding window is model.attention_window, whatever the length."""
  d = write_config(str(tmp_path / "llama31"), max_position_embeddings=131072)
  model = configs.build(configs.get(f"hf:{d}")).model
  assert model.max_len == 4096
  assert hf_llama.to_hf(model, "llama", hf_models.read(d))["max_position_embeddings"] == 131072
  d = write_config(str(tmp_path / "mistral"), "mistral", max_position_embeddings=32768, sliding_window=4096)
  model = configs.build(configs.get(f"hf:{d}")).model
  out = hf_llama.to_hf(model, "mistral", hf_models.read(d))
  assert (model.max_len, model.attention_window) == (4096, 4096)
  assert (out["max_position_embeddings"], out["sliding_window"]) == (32768, 4096)
  longer = dataclasses.replace(model, max_len=65536)
  out = hf_llama.to_hf(longer, "mistral", hf_models.read(d))
  assert (out["max_position_embeddings"], out["sliding_window"]) == (65536, 4096)


def test_sliding_window_is_the_attention_window_not_a_length_cap():
  """Mistral's sliding_window 6 with max_position_embeddings 512: the model attends within 6
  tokens at any length up to 512 (the greedy test decodes 32 + 48 tokens with it), raising
  max_len keeps the window, and export declares the model's window."""
  model = experiment("mistral_window").model
  assert (model.max_len, model.attention_window) == (512, 6)
  src = hf_models.read(os.path.join(FIXTURES, "mistral_window"))
  assert hf_llama.to_hf(model, "mistral", src)["sliding_window"] == 6
  model = experiment("mistral_window", "model.max_len=1024", "model.attention_window=16").model
  out = hf_llama.to_hf(model, "mistral", src)
  assert (out["max_position_embeddings"], out["sliding_window"]) == (1024, 16)
  moe = experiment("mixtral_llama3").model
  assert (moe.max_len, moe.attention_window, moe.rope_scaling.kind) == (512, 8, "llama3")
  with pytest.raises(ConfigError, match="attention_window=6"):   # Llama has no sliding_window
    hf_llama.check_exportable(experiment("llama", "model.attention_window=6").model, "llama")


def test_mixtral_with_attention_biases_and_llama3_rope_round_trips(tmp_path):
  """A Mixtral config.json with attention_bias=true (q/k/v/o biases; transformers' own
  MixtralAttention has none, so the biases are written here) and llama3 rope imports, its
  bias tensors go into the attention's bias params (export reads them back from the
  restored params bit for bit) and export declares both."""
  src = os.path.join(FIXTURES, "mixtral_llama3")
  d = write_config(str(tmp_path / "m"), "mixtral_llama3", attention_bias=True)
  shutil.copy(os.path.join(src, "tokenizer.json"), d)
  reader, rng = safetensors.Reader(src), np.random.default_rng(0)
  tensors = {n: reader.get(n) for n in reader.names()}
  for i in range(2):
    for proj, size in (("q", 64), ("k", 32), ("v", 32), ("o", 64)):
      tensors[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(size).astype(np.float32)
  safetensors.write(os.path.join(d, "model.safetensors"),
                    [(n, t.shape, t.dtype) for n, t in tensors.items()], tensors.__getitem__)
  exp = configs.build(configs.get(f"hf:{d}"))
  t = exp.model
  assert (t.qkv_bias, t.out_bias, t.rope_scaling.kind) == (True, True, "llama3")
  out = through_checkpoint(exp, tmp_path)
  b = safetensors.Reader(out)
  assert sorted(b.names()) == sorted(tensors)
  for name in b.names():
    assert b.get(name).tobytes() == tensors[name].tobytes(), name
  out_cfg = hf_models.read(out)
  assert out_cfg["attention_bias"] is True and out_cfg["rope_parameters"]["rope_type"] == "llama3"
  assert hf_llama.model_fields(out_cfg) == hf_llama.model_fields(hf_models.read(d))


def test_config_reads_transformers_4_rope_spelling(tmp_path):
  d = write_config(str(tmp_path / "m"), rope_parameters=None, rope_theta=5e5, rope_scaling={
      "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})
  m = configs.build(configs.get(f"hf:{d}")).model
  assert (m.rope_theta, m.rope_scaling) == \
      (5e5, RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=8192))


def _write_random_model(d, layers, dm=256, ff=1024, vocab=1024):
  """(model bytes, bytes of one stacked [layers, ff, dm] leaf, largest tensor's bytes) of a
  random `layers`-deep Llama written to `d` as 8+ safetensors files of float32 tensors."""
  write_config(d, num_hidden_layers=layers, hidden_size=dm, intermediate_size=ff, vocab_size=vocab,
               num_attention_heads=4, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
  specs = [("model.embed_tokens.weight", (vocab, dm)), ("model.norm.weight", (dm,)),
           ("lm_head.weight", (vocab, dm))]
  for i in range(layers):
    p = f"model.layers.{i}."
    specs += [(p + "input_layernorm.weight", (dm,)), (p + "post_attention_layernorm.weight", (dm,))]
    specs += [(p + f"self_attn.{n}_proj.weight", (dm, dm)) for n in "qkvo"]
    specs += [(p + "mlp.gate_proj.weight", (ff, dm)), (p + "mlp.up_proj.weight", (ff, dm)),
              (p + "mlp.down_proj.weight", (dm, ff))]
  shapes = dict(specs)
  rng = np.random.default_rng(0)
  safetensors.write_model(d, [(n, s, np.dtype(np.float32)) for n, s in specs],
                          lambda n: rng.standard_normal(shapes[n], np.float32), max_bytes=4 << 20)
  assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) >= 8
  sizes = [int(np.prod(s)) * 4 for s in shapes.values()]
  return sum(sizes), layers * ff * dm * 4, max(sizes)


def test_import_streams_tensor_by_tensor(tmp_path):
  """The host memory the importer holds at its peak (numpy buffers and reads, counted by
  tracemalloc, which numpy reports its data allocations to) is a param's host buffer (a
  stacked [layers, ...] leaf of 24 MB; an earlier leaf's can linger until the runtime's
  transfer thread hands it back: 25 to 49 MB seen here) plus a few tensors, never the 98 MB
  model: reading everything first holds 147 MB. Counting allocations rather than the resident
  set makes the figure exact: the RSS of the runtime's thread pools and arenas differed by
  tens of MB between machines."""
  import tracemalloc
  d = str(tmp_path / "model")
  total, leaf, tensor = _write_random_model(d, layers=24)
  cfg = configs.get("hf:" + d)
  cfg.mesh.ici = (1, 1)
  exp = configs.build(cfg)
  setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  tracemalloc.start()
  try:
    with jax.set_mesh(setup.mesh), use_rules(setup.rules):
      params = importer.import_params(setup, d)
      jax.block_until_ready(params)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  print(f"import of {total / 2**20:.0f} MB: importer's host peak {peak / 2**20:.1f} MB "
        f"(largest leaf {leaf / 2**20:.0f} MB, largest tensor {tensor / 2**20:.0f} MB)")
  assert peak < 3 * leaf + 4 * tensor < total, (peak, leaf, tensor, total)


@pytest.mark.slow   # a process start, an import, a train and an eval compile: ~60-120 s on 2 busy cores
def test_first_train_of_an_hf_experiment_imports_then_resumes(tmp_path):
  """The CLI: an empty job dir's first --mode=train imports (step 0), then trains from it."""
  from clitools import run
  job = tmp_path / "job"
  args = [sys.executable, "-m", "shardax.main", f"--exp=hf:{os.path.join(FIXTURES, 'qwen2')}",
          f"--job_dir={job}", "--mode=train", "--set", "data.source='synthetic'", "--set", "data.seq_len=16",
          "--set", "train.steps=1", "--set", "train.global_batch=2", "--set", "train.eval_every=1000",
          "--set", "checkpoint.async_save=False"]
  out = run(args)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "imported" in out.stderr and "resumed from step 0" in out.stderr, out.stderr[-2000:]
  assert sorted(os.listdir(job / "checkpoints")) == ["0", "1"]
