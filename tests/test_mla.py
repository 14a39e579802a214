"""Multi-head latent attention (layers/mla.py) and YaRN RoPE (layers/rope.py).

Checked against transformers (tests/fixtures/mla/, written by make_mla_fixtures.py: its
DeepseekV3Attention's output and YaRN frequencies), and by properties that need no
reference: a cached decode (prefill, then one token at a time over the compressed latent)
equals the full forward; an LM with MLA computes on 8 devices (FSDP, 2D, ring context
parallelism) what it computes on one; every attention path (xla, fused, flash) agrees.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax import configs, models
from shardax.configs.mla import MLAConfig
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError
from shardax.layers import rope
from shardax.layers.attention import AttentionOptions
from shardax.layers.rope import rope_inv_freq
from shardax.layers.mla import MultiHeadLatentAttention, mla_cache_spec
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, packed_batch, setup_for, tiny_lm

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "mla")
SMALL = MLAConfig(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
D_MODEL, HEADS = 32, 4
# The fixture's YaRN: mscale != mscale_all_dim, so cos/sin and the softmax scale both change.
FIXTURE_YARN = RopeScaling("yarn", factor=4.0, original_max_len=8, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                           mscale_all_dim=0.5)


def layer(mla=SMALL, rope_scaling=None, theta=10_000.0, options=None, seed=0,
          interleave=False) -> MultiHeadLatentAttention:
  with nnx.use_eager_sharding(False):
    return MultiHeadLatentAttention(D_MODEL, HEADS, mla, rope_theta=theta, rope_scaling=rope_scaling,
                                    rope_interleave=interleave, options=options, rngs=nnx.Rngs(seed))


def load_transformers(attn: MultiHeadLatentAttention, w: dict) -> None:
  """transformers' DeepseekV3Attention weights ([out, in]) into `attn`: one tensor per param."""
  m, n = attn.mla, attn.num_heads
  heads = lambda t: t.T.reshape(t.shape[1], n, -1)
  if m.q_lora_rank is None:
    attn.query.kernel[...] = jnp.asarray(heads(w["q_proj.weight"]))
  else:
    attn.q_down.kernel[...] = jnp.asarray(w["q_a_proj.weight"].T)
    attn.q_norm.scale[...] = jnp.asarray(w["q_a_layernorm.weight"])
    attn.q_up.kernel[...] = jnp.asarray(heads(w["q_b_proj.weight"]))
  attn.kv_down.kernel[...] = jnp.asarray(w["kv_a_proj_with_mqa.weight"].T)
  attn.kv_norm.scale[...] = jnp.asarray(w["kv_a_layernorm.weight"])
  attn.kv_up.kernel[...] = jnp.asarray(heads(w["kv_b_proj.weight"]))
  attn.out.kernel[...] = jnp.asarray(w["o_proj.weight"].T.reshape(n, m.v_head_dim, -1))


@pytest.mark.parametrize("case,mla,scaling,theta,interleave", [
    ("lora_yarn_interleave", MLAConfig(12, 16, 8, 4, 6), FIXTURE_YARN, 10_000.0, True),
    ("plain_q", MLAConfig(None, 16, 8, 4, 6), None, 500.0, False),
])
def test_equals_transformers_deepseek_v3_attention(case, mla, scaling, theta, interleave):
  w = dict(np.load(os.path.join(FIXTURES, f"attention_{case}.npz")))
  attn = layer(mla, scaling, theta, interleave=interleave)
  load_transformers(attn, w)
  out = jax.jit(lambda x, pos: attn(x, pos))(w["x"], w["positions"])
  np.testing.assert_allclose(np.asarray(out), w["out"], rtol=2e-5, atol=2e-5)


def test_yarn_frequencies_and_cos_sin_factor_equal_transformers():
  """DeepSeek-V3's and gpt-oss's published YaRN parameters (gpt-oss: truncate=False)."""
  for name, case in json.load(open(os.path.join(FIXTURES, "yarn.json"))).items():
    r = case["rope"]
    yarn = RopeScaling("yarn", factor=r["factor"], original_max_len=r["original_max_position_embeddings"],
                       beta_fast=r["beta_fast"], beta_slow=r["beta_slow"], mscale=r.get("mscale", 0.0),
                       mscale_all_dim=r.get("mscale_all_dim", 0.0), truncate=r.get("truncate", True))
    got = np.asarray(rope_inv_freq(case["head_dim"], r["rope_theta"], yarn))
    np.testing.assert_allclose(got, case["inv_freq"], rtol=2e-6, err_msg=name)
    np.testing.assert_allclose(yarn.cos_sin_scale, case["attention_factor"], rtol=1e-12, err_msg=name)


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_is_plain_rope_at_factor_1():
  d, theta = 64, 10_000.0
  plain = np.asarray(rope_inv_freq(d, theta, None))
  yarn = rope.yarn_inv_freq(d, theta, RopeScaling("yarn", factor=8.0, original_max_len=4096))
  assert np.allclose(yarn[:8], plain[:8], rtol=1e-6)            # > 32 rotations in 4096: kept
  assert np.allclose(yarn[-4:], plain[-4:] / 8.0, rtol=1e-6)    # < 1 rotation: interpolated
  assert np.all(np.diff(yarn / plain) <= 1e-6)                   # a monotone ramp in between
  np.testing.assert_allclose(rope.yarn_inv_freq(d, theta, RopeScaling("yarn", factor=1.0, original_max_len=4096)), plain, rtol=1e-6)


def decode_outputs(attn, x, prefill: int, slots: int = 16):
  spec = mla_cache_spec(x.shape[0], slots, attn.mla, jnp.float32)
  cache = {k: jnp.zeros(v.shape, v.dtype) for k, v in spec.items()}
  b = x.shape[0]
  step = jax.jit(lambda x, pos, cache: attn.cached(x, pos, cache))
  out, cache = step(x[:, :prefill], jnp.broadcast_to(jnp.arange(prefill), (b, prefill)), cache)
  outs = [out]
  for t in range(prefill, x.shape[1]):
    o, cache = step(x[:, t:t + 1], jnp.full((b, 1), t, jnp.int32), cache)
    outs.append(o)
  return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("scaling", [None, FIXTURE_YARN], ids=["rope", "yarn"])
def test_cached_decode_over_the_latent_equals_the_full_forward(q_lora_rank, scaling):
  """Prefill 4 tokens, then 6 generate steps, each attending to the cached latent and RoPE
  key with W_uk absorbed into the query: the same outputs as one causal forward pass."""
  mla = MLAConfig(q_lora_rank, 16, 8, 4, 6)
  attn = layer(mla, scaling, options=AttentionOptions(window=5), interleave=scaling is not None)
  x = jax.random.normal(jax.random.key(1), (2, 10, D_MODEL))
  full = jax.jit(lambda x: attn(x))(x)
  decoded, cache = decode_outputs(attn, x, prefill=4)
  np.testing.assert_allclose(np.asarray(decoded), np.asarray(full), rtol=1e-5, atol=1e-5)
  assert {k: v.shape for k, v in cache.items()} == {"latent": (2, 16, 16), "k_rope": (2, 16, 4)}


def test_packed_documents_attend_only_within_themselves():
  """A row holding two documents (segment ids 1, 2; positions restarting at 0) gives each
  document's output of it run alone."""
  attn = layer(rope_scaling=FIXTURE_YARN)
  x = jax.random.normal(jax.random.key(3), (1, 10, D_MODEL))
  seg = jnp.asarray([[1] * 4 + [2] * 6], jnp.int32)
  pos = jnp.asarray([list(range(4)) + list(range(6))], jnp.int32)
  packed = jax.jit(lambda x: attn(x, pos, seg))(x)
  alone = [jax.jit(lambda x: attn(x))(x[:, :4]), jax.jit(lambda x: attn(x))(x[:, 4:])]
  np.testing.assert_allclose(np.asarray(packed), np.concatenate(alone, 1), rtol=1e-5, atol=1e-5)


def test_attention_paths_agree_with_a_narrower_v():
  """v_head_dim 6 < q/k's 12: 'fused' pads v, the splash kernel (interpret mode) takes it."""
  x = jax.random.normal(jax.random.key(2), (1, 128, D_MODEL))
  ref = jax.jit(lambda x: layer()(x))(x)
  for options in (AttentionOptions("fused"),
                  AttentionOptions("flash", interpret=True, flash_block_q=128, flash_block_kv=128)):
    out = jax.jit(lambda x: layer(options=options)(x))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5,
                               err_msg=options.implementation)


MLA_LM = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=16", "model.mla.qk_nope_head_dim=8",
          "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6", "model.rope_scaling.kind='yarn'",
          "model.rope_scaling.factor=4.0", "model.rope_scaling.original_max_len=8", "model.rope_scaling.mscale=1.0",
          "model.rope_scaling.mscale_all_dim=0.5"]


PACKED = ["data.source='stdlib'"]   # batches carry segment ids, positions and a loss mask


@pytest.fixture(scope="module")
def reference():
  """Params, a packed batch (3 documents a row: segment ids and positions restart) and loss
  and grads on one device."""
  exp = tiny_lm(2, 8, ici=(1, 1), extra=MLA_LM + PACKED)
  setup = setup_for(exp, jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  batch = packed_batch(np.random.default_rng(0), 8, 16)
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  return params, batch, float(loss), jax.device_get(grads)


def _batch():
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@pytest.mark.parametrize("ici,axes,preset,extra", [
    ((8, 1), ("data", "model"), "fsdp", []),
    ((2, 4), ("data", "model"), "2d", []),
    ((2, 4), ("data", "context"), "dp_cp", ["model.context_parallel='ring'"]),
], ids=["fsdp", "2d", "ring_cp"])
def test_lm_with_mla_sharded_equals_one_device(reference, ici, axes, preset, extra):
  params, batch, ref_loss, ref_grads = reference
  setup = setup_for(tiny_lm(2, 8, ici=ici, axes=axes, preset=preset, extra=MLA_LM + PACKED + extra))
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
  assert "kv_up" in str(jax.tree_util.tree_structure(grads))


def test_pipelined_and_rematerialized_lm_with_mla_equals_one_device(reference):
  """2 stages x 2 microbatches on (stage 2, data 4), each stage's layer recomputed ('full')."""
  from shardax import pipeline
  params, batch, ref_loss, ref_grads = reference
  setup = setup_for(tiny_lm(2, 8, stages=2, micro=2, ici=(2, 4), axes=("stage", "data"), preset="pp_dp",
                            extra=MLA_LM + PACKED + ["model.remat='full'"]))
  params = dict(params, layers=pipeline.stage_params(params["layers"], 2, 1))
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  grads = jax.device_get(grads)
  grads["layers"] = pipeline.unstage_params(grads["layers"], 1)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


def test_lm_decode_caches_the_latent_and_equals_the_full_forward(reference):
  """Through the stack (scanned blocks, Block picking MLA): prefill then steps, the logits
  of a full forward; the cache is [layers, b, S, kv_lora_rank] + [layers, b, S, rope dims]."""
  exp = tiny_lm(2, 8, ici=(1, 1), extra=MLA_LM)
  params = reference[0]
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: models.build(exp.model, nnx.Rngs(0)))
  graphdef = nnx.split(model, nnx.Param, ...)[0]
  spec = model.cache_spec(2, 16)
  assert {k: v.shape for k, v in spec.items()} == {"latent": (2, 2, 16, 16), "k_rope": (2, 2, 16, 4)}
  tokens = _batch()["inputs"][:2, :12]
  full = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
  step = jax.jit(lambda p, t, pos, c: nnx.merge(graphdef, p).cached(t, pos, c)[:2])
  cache = {k: jnp.zeros(v.shape, v.dtype) for k, v in spec.items()}
  logits, cache = step(params, tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
  outs = [logits]
  for t in range(5, 12):
    logits, cache = step(params, tokens[:, t:t + 1], jnp.full((2, 1), t, jnp.int32), cache)
    outs.append(logits)
  np.testing.assert_allclose(np.concatenate(outs, 1), np.asarray(full), rtol=1e-4, atol=1e-4)


def test_sharded_2d_decode_equals_one_device(reference):
  """Greedy decode of prompts of different lengths on (2, 4) with the 2d rules (rows of the
  latent cache over data, heads over model) gives one device's tokens."""
  from shardax.sharding import make_mesh
  from shardax.trainer import decode
  params = jax.tree.map(lambda a: a * 2.0, reference[0])   # sharp attention: tokens depend on context
  prompts = [np.arange(1, n + 1, dtype=np.int32) * 7 % 255 + 1 for n in (3, 9, 1, 6)]
  ids = []
  for ici, preset in (((1, 1), "dp"), ((2, 4), "2d")):
    exp = tiny_lm(2, 8, ici=ici, preset=preset, extra=MLA_LM)
    setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:int(np.prod(ici))]))
    gen = decode.Generator(exp.model, jax.device_put(params, setup.shardings["params"]), setup.mesh, setup.rules)
    ids.append(gen.run(prompts, decode.Sampling(max_new_tokens=6)).ids)
  np.testing.assert_array_equal(ids[1], ids[0])
  assert len({tuple(r) for r in np.asarray(ids[0]).tolist()}) > 1


@pytest.mark.parametrize("override,field", [
    ("model.num_kv_heads=2", "model.num_kv_heads"),
    ("model.head_dim=16", "model.head_dim"),
    ("model.qk_norm=True", "model.qk_norm"),
    ("model.mla.qk_rope_head_dim=5", "model.mla.qk_rope_head_dim"),
    ("model.mla.q_lora_rank=0", "model.mla.q_lora_rank"),
])
def test_config_errors_name_the_field(override, field):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, ["model.mla.kv_lora_rank=16", override])
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    configs.build(cfg)


def compiled_forward_flops(exp) -> float:
  from shardax.sharding import use_rules
  from shardax.trainer import step as step_lib
  setup = setup_for(exp, jax.devices()[:1])
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    compiled = jax.jit(lambda p, x: step_lib.loss_fn(setup)(p, x)[0]).lower(
        setup.abstract["params"], step_lib.abstract_batch(setup)).compile()
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_flop_and_param_counts_are_what_the_mla_model_runs():
  """configs/flops.py: param_count is the model's, matmul_params its projections and head, and
  the forward FLOPs the compiler counts are the formula's (training / 3) plus what it leaves
  out: the causally masked half of the scores (QK^T over q/k's 12 dims, AV over v's 6; the
  XLA path computes the square) and the embedding lookup (a one-hot matmul on CPU). Widening
  v by 8 adds exactly what the formula says: value_up and out columns, and the AV scores."""
  from shardax.configs import flops
  unscanned = MLA_LM + ["model.scan_layers=False"]
  exp = tiny_lm(2, 8, ici=(1, 1), extra=unscanned)
  t, s, b = exp.model, exp.data.seq_len, exp.train.global_batch
  with nnx.use_eager_sharding(False):
    model = models.build(t, nnx.Rngs(0))
  total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert t.param_count() == total
  norms = t.num_layers * (2 * t.d_model + 16 + 16) + t.d_model   # block norms + q/kv latent norms, final
  # the head is counted even when tied to the embedding table; an untied table is a lookup only
  assert flops.matmul_params(t) == total - norms - (0 if t.tied_embedding else t.vocab_size * t.d_model)
  counted = compiled_forward_flops(exp)
  masked_half = t.num_layers * s * t.num_heads * (12 + 6) * b * s
  lookup = 2 * b * s * t.vocab_size * t.d_model
  ratio = counted / (flops.per_token(t, s) * s * b / 3 + masked_half + lookup)
  assert 1.0 <= ratio <= 1.10, (counted, ratio)
  wide = tiny_lm(2, 8, ici=(1, 1), extra=unscanned + ["model.mla.v_head_dim=14"])
  formula = (flops.per_token(wide.model, s) - flops.per_token(t, s)) * s * b / 3
  formula += t.num_layers * s * t.num_heads * 8 * b * s          # the masked half of AV's extra width
  assert compiled_forward_flops(wide) - counted == pytest.approx(formula, rel=0.02)


def test_explain_reports_the_latent_cache_against_full_keys_and_values():
  """--mode=explain: the decode cache is layers x rows x slots x (kv_lora_rank + rope dims)
  float32 values, and the per-token line compares it with every head's keys and values."""
  from shardax.trainer import explain
  exp = tiny_lm(2, 8, ici=(8, 1), preset="fsdp", extra=MLA_LM)
  text = explain.explain(exp)
  total = 2 * 8 * 16 * (16 + 4) * 4            # layers, rows, max_len slots, latent + RoPE key, f32
  assert f"decode KV cache (8 rows x 16 slots): {total:,} bytes, {total // 8:,} per device" in text
  assert ("decode cache per token and layer (MLA): latent 16 + RoPE key 4 = 80 bytes, against 288 for "
          "full keys and values (4 heads x (12 + 6)): 3.6x less") in text
