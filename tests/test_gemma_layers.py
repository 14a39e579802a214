"""Gemma's model options in the one decoder (Gemma 2/3: models/hf/gemma.py maps them):

  model.norm='rms_plus_one'     RMSNorm scaled by (1 + w), w stored (block, post, final, q/k norms)
  model.post_norms              a norm on each branch's output before the residual add
  model.query_pre_attn_scalar   the softmax scale s^-1/2 instead of head_dim^-1/2
  model.final_logit_softcap     logits -> cap * tanh(logits / cap)
  model.rope_scaling.kind='linear'  frequencies / factor; LayerKind.rope_scaled=False leaves a kind unscaled

Each is checked against its definition or an equivalent model without it, then all together
through every path: scan and list stacks with a pattern's tail, decode, 8 sharded devices,
context parallelism, the flash kernel, the pipeline with remat.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardax import pipeline
from shardax.configs import flops
from shardax.configs.attention import AttentionOptions, LayerKind
from shardax.configs.mla import MLAConfig
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ConfigError, TransformerConfig
from shardax.layers import attention as attn_lib
from shardax.layers.blocks import Block
from shardax.layers.transformer import TransformerLM
from meshtools import loss_and_grads, setup_for, tiny_lm
from test_layers import random_state
from test_layer_pattern import decode_logits

LOCAL = LayerKind(window=3, rope_theta=100.0, rope_scaled=False)
GLOBAL = LayerKind()
# 5 layers of a (local, global) pattern: 2 units and a tail of one local layer.
GEMMA = TransformerConfig(vocab_size=64, num_layers=5, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                          d_ff=64, max_len=16, layer_pattern=(LOCAL, GLOBAL),
                          rope_scaling=RopeScaling("linear", factor=4.0), norm="rms_plus_one", post_norms=True, qk_norm=True,
                          query_pre_attn_scalar=5.0, final_logit_softcap=3.0, attention_softcap=4.0,
                          activation="gelu", scan_layers=False)
B, L = 2, 12


def tokens_of(seed, shape=(B, L)):
  return np.random.default_rng(seed).integers(0, 64, size=shape).astype(np.int32)


def test_plus_one_norms_are_plain_norms_of_one_plus_w():
  """Every norm of the model (pre, post, final, q/k) with w equals a plain-RMSNorm model with
  scale 1 + w; init w = 0 is the unit scale."""
  graphdef, state = random_state(lambda: TransformerLM(GEMMA, rngs=nnx.Rngs(0)), seed=1)
  params = nnx.to_pure_dict(state)
  plain_cfg = dataclasses.replace(GEMMA, norm="rms")
  g2, s2 = nnx.split(nnx.eval_shape(lambda: TransformerLM(plain_cfg, rngs=nnx.Rngs(0))))
  shifted = jax.tree_util.tree_map_with_path(
      lambda p, v: v + 1.0 if getattr(p[-1], "key", None) == "scale" else v, params)
  assert sum(getattr(p[-1], "key", None) == "scale" for p, _ in jax.tree_util.tree_leaves_with_path(params)) == \
      5 * 6 + 1                                  # per layer: 4 block norms + q/k; the final norm
  nnx.replace_by_pure_dict(s2, shifted)
  tokens = tokens_of(0)
  got = jax.jit(nnx.merge(graphdef, state))(tokens)
  np.testing.assert_allclose(got, jax.jit(nnx.merge(g2, s2))(tokens), rtol=1e-5, atol=1e-5)
  with nnx.use_eager_sharding(False):
    fresh = TransformerLM(GEMMA, rngs=nnx.Rngs(0))
  assert float(jnp.abs(fresh.final_norm.scale[...]).max()) == 0.0


@pytest.mark.parametrize("impl", ["xla", "flash"])
def test_query_pre_attn_scalar_is_the_softmax_scale(impl):
  """softmax(q.k * s^-1/2) v (with the logit soft-cap after the scale), on the einsum path
  and the splash kernel, in training and in the decode cache."""
  l = 128 if impl == "flash" else 16
  opts = AttentionOptions(impl, softcap=2.0, interpret=True, flash_block_q=128, flash_block_kv=128)
  with nnx.use_eager_sharding(False):
    layer = attn_lib.Attention(32, 4, 2, 8, rope=False, softmax_scale=3.0 ** -0.5, options=opts, rngs=nnx.Rngs(0))
  x = np.random.default_rng(1).normal(size=(B, l, 32)).astype(np.float32)
  pos = np.broadcast_to(np.arange(l), (B, l))
  w = lambda m: np.asarray(m.kernel[...], np.float64)
  q, k, v = (np.einsum("ble,ehd->blhd", x, w(p)) for p in (layer.query, layer.key, layer.value))
  k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)
  logits = 2.0 * np.tanh(np.einsum("blhd,bshd->bhls", q, k) * 3.0 ** -0.5 / 2.0)
  logits = np.where(np.tril(np.ones((l, l), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  o = np.einsum("bhls,bshd->blhd", p / p.sum(-1, keepdims=True), v)
  want = np.einsum("blhd,hde->ble", o, w(layer.out))
  np.testing.assert_allclose(jax.jit(lambda x, p: layer(x, p))(x, pos), want, rtol=1e-4, atol=1e-4)
  if impl == "xla":   # a generate step reads the cache with the same scale
    cache = attn_lib.kv_cache_spec(B, l, 2, 8, jnp.float32)
    cache = {n: jnp.zeros(c.shape, c.dtype) for n, c in cache.items()}
    _, cache = layer.cached(x[:, :l - 1], pos[:, :l - 1], cache)
    out, _ = layer.cached(x[:, l - 1:], pos[:, l - 1:], cache)
    np.testing.assert_allclose(out[:, 0], want[:, -1], rtol=1e-4, atol=1e-4)


def test_final_logit_softcap_caps_logits_and_the_loss_sees_them():
  """Logits are cap * tanh(uncapped / cap); the loss (also computed in chunks) is the cross
  entropy of the capped logits."""
  graphdef, state = random_state(lambda: TransformerLM(GEMMA, rngs=nnx.Rngs(0)), seed=2)
  params = nnx.to_pure_dict(state)
  uncapped_cfg = dataclasses.replace(GEMMA, final_logit_softcap=None)
  g2, s2 = nnx.split(nnx.eval_shape(lambda: TransformerLM(uncapped_cfg, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(s2, params)
  tokens = tokens_of(3, (B, L + 1))
  raw = np.asarray(jax.jit(nnx.merge(g2, s2))(tokens[:, :-1]), np.float64)
  assert np.abs(raw).max() > 3.0          # the cap changes something here
  capped = 3.0 * np.tanh(raw / 3.0)
  np.testing.assert_allclose(jax.jit(nnx.merge(graphdef, state))(tokens[:, :-1]), capped, rtol=1e-5, atol=1e-5)
  want = float(optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(capped), tokens[:, 1:]).mean())
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  for chunk in (0, 4):
    cfg = dataclasses.replace(GEMMA, loss_chunk=chunk)
    g3, s3 = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(s3, params)
    loss, _ = jax.jit(lambda s, b: nnx.merge(g3, s).loss_and_metrics(b))(s3, batch)
    assert float(loss) == pytest.approx(want, rel=1e-5), f"loss_chunk={chunk}"


def test_linear_rope_is_positions_divided_by_the_factor():
  x = np.random.default_rng(4).normal(size=(B, L, 2, 8)).astype(np.float32)
  pos = np.broadcast_to(np.arange(L) * 4, (B, L))
  got = attn_lib.apply_rope(x, pos, 100.0, RopeScaling("linear", factor=4.0))
  np.testing.assert_allclose(got, attn_lib.apply_rope(x, pos // 4, 100.0, None), rtol=1e-5, atol=1e-5)


def test_unscaled_kind_ignores_the_models_rope_scaling():
  """A kind with rope_scaled=False rotates as the model with rope_scaling=None; a scaled
  kind differs."""
  x = np.random.default_rng(5).normal(size=(B, L, 32)).astype(np.float32)
  pos = attn_lib.default_positions(B, L)
  plain = dataclasses.replace(GEMMA, rope_scaling=None)
  with nnx.use_eager_sharding(False):
    ref = Block(plain, kind=LayerKind(), rngs=nnx.Rngs(0))
    unscaled = Block(GEMMA, kind=LayerKind(rope_scaled=False), rngs=nnx.Rngs(0))
    scaled = Block(GEMMA, kind=LayerKind(), rngs=nnx.Rngs(0))
  run = jax.jit(lambda m, x, p: m(x, p)[0])
  want = run(ref, x, pos)
  np.testing.assert_allclose(run(unscaled, x, pos), want, rtol=1e-6, atol=1e-6)
  assert float(jnp.abs(run(scaled, x, pos) - want).max()) > 1e-3


@pytest.mark.parametrize("scan", [False, True])
def test_decode_equals_the_full_forward(scan):
  """Prefill 5 tokens, then generate steps to 12 (past the local window of 3)."""
  cfg = dataclasses.replace(GEMMA, scan_layers=scan)
  graphdef, state = random_state(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)), seed=6)
  model = nnx.merge(graphdef, state)
  tokens = tokens_of(7)
  got, _ = decode_logits(model, tokens, prompt=5)
  np.testing.assert_allclose(got, jax.jit(model)(tokens), rtol=2e-5, atol=2e-5)


GEMMA_SET = ["model.layer_pattern=({'window': 3, 'rope_theta': 100.0, 'rope_scaled': False}, {})",
             "model.rope_scaling.kind='linear'", "model.rope_scaling.factor=4.0", "model.norm='rms_plus_one'",
             "model.post_norms=True", "model.qk_norm=True", "model.query_pre_attn_scalar=5.0",
             "model.final_logit_softcap=3.0", "model.attention_softcap=4.0", "model.activation='gelu'"]


@pytest.fixture(scope="module")
def one_device():
  exp = tiny_lm(5, 8, extra=GEMMA_SET)
  assert exp.model.layer_pattern == (LOCAL, GLOBAL) and exp.model.num_tail_layers == 1
  graphdef, state = random_state(lambda: TransformerLM(exp.model, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  tokens = np.random.default_rng(8).integers(0, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, _), _ = loss_and_grads(setup_for(exp, jax.devices()[:1]), params, batch)
  return params, batch, loss, grads


@pytest.mark.parametrize("preset,ici,axes", [("fsdp", (8, 1), ("data", "model")), ("2d", (2, 4), ("data", "model")),
                                             ("dp_cp", (2, 4), ("data", "context"))])
def test_sharded_gemma_model_equals_one_device(one_device, preset, ici, axes):
  """Loss and grads on 8 devices (fsdp, 2d, context parallel) equal one device's."""
  params, batch, loss1, grads1 = one_device
  exp = tiny_lm(5, 8, ici=ici, axes=axes, preset=preset, extra=GEMMA_SET + ["model.context_parallel='ring'"])
  (loss8, grads8, _), _ = loss_and_grads(setup_for(exp), params, batch)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads8, grads1)


def test_pipelined_gemma_model_equals_the_scanned_one():
  """4 layers (2 units of the local/global pattern) in 2 pipeline stages, remat 'full': the
  loss equals the scanned stack's on one device with the same weights."""
  piped = tiny_lm(4, 8, stages=2, micro=2, ici=(2, 4), axes=("stage", "data"), preset="pp_dp",
                  extra=GEMMA_SET + ["model.remat='full'"])
  plain = tiny_lm(4, 8, extra=GEMMA_SET)
  graphdef, state = random_state(lambda: TransformerLM(piped.model, rngs=nnx.Rngs(0)), seed=9)
  params = nnx.to_pure_dict(state)
  flat = jax.tree.map(np.asarray, params)
  flat["layers"]["blocks"] = jax.tree.map(lambda a: np.asarray(pipeline.from_stages(a)), flat["layers"]["blocks"])
  tokens = np.random.default_rng(10).integers(0, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss_p, _, _), _ = loss_and_grads(setup_for(piped), params, batch)
  (loss_s, _, _), _ = loss_and_grads(setup_for(plain, jax.devices()[:1]), flat, batch)
  np.testing.assert_allclose(loss_p, loss_s, rtol=1e-5)


def test_param_count_counts_the_post_norms():
  """flops.param_count equals the built model's params less the q/k norms (not counted)."""
  _, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(GEMMA, rngs=nnx.Rngs(0))))
  total = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.to_pure_dict(state)))
  assert flops.param_count(GEMMA) == total - GEMMA.num_layers * 2 * 8


@pytest.mark.parametrize("fields,named", [
    (dict(post_norms=True, parallel_block=True), "model.post_norms"),
    (dict(query_pre_attn_scalar=0.0), "model.query_pre_attn_scalar"),
    (dict(final_logit_softcap=-1.0), "model.final_logit_softcap"),
    (dict(norm="gemma"), "model.norm='gemma'"),
    (dict(norm="rms_plus_one", mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                               v_head_dim=8)), "model.norm='rms_plus_one' with model.mla"),
])
def test_bad_gemma_options_are_refused_by_name(fields, named):
  with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(".", r"\.")):
    TransformerConfig(**fields)
