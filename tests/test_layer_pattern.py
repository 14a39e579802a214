"""Per-layer attention kinds (`model.layer_pattern`): each layer attends as its kind says, the
stack repeats lcm(len(pattern), moe.every) layers with a tail after the last whole unit, and
every way of running the stack (scanned or a list, remat, decode cache, sharded, pipelined)
computes what the layers computed one after another would.

Kinds: a sliding window, chunked local attention (Llama 4), NoPE with temperature tuning
(Llama 4), a RoPE base of its own (Gemma 3). Chunked attention and the NoPE temperature are
checked against their definitions in numpy; the model against its layers run in order.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax import configs, pipeline
from shardax.configs.attention import AttentionOptions, LayerKind
from shardax.configs.moe import MoEConfig
from shardax.configs.schema import ConfigError, TransformerConfig
from shardax.layers import attention as attn_lib
from shardax.layers.blocks import Block
from shardax.layers.transformer import STATE_UPDATES, TransformerLM, moe_layer
from shardax.configs.pipeline import PipelineConfig
from shardax.sharding import use_rules
from meshtools import loss_and_grads, packed_batch, setup_for, tiny_lm
from test_layers import random_state

WINDOW, CHUNK, FLOOR = LayerKind(window=3), LayerKind(chunk=4), 4.0
NOPE = LayerKind(rope=False, temperature_tuning=True)
THETA = LayerKind(rope_theta=100.0)
PATTERN = (WINDOW, CHUNK, NOPE, THETA)
# 7 layers of a 4-kind pattern: one scanned unit (layers 0-3) and a tail (layers 4-6: kinds 0-2)
CFG = TransformerConfig(vocab_size=64, num_layers=7, d_model=32, num_heads=4, num_kv_heads=2,
                        d_ff=64, max_len=16, layer_pattern=PATTERN, temperature_floor_scale=FLOOR,
                        temperature_scale=0.5, scan_layers=False)
B, L = 2, 12


def reference_attention(q, k, v, visible):
  """Softmax attention in numpy (float64) with a boolean mask visible[q, s]; GQA by h // g."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = np.einsum("bqhd,bshd->bhqs", q, k) / np.sqrt(q.shape[-1])
  logits = np.where(visible[:, None], logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhqs,bshd->bqhd", p, v)


def chunk_mask(l, chunk, segment_ids=None):
  """The definition: query i sees key j iff j <= i and both lie in one chunk (and segment)."""
  i, j = np.arange(l)[:, None], np.arange(l)[None, :]
  mask = np.broadcast_to((j <= i) & (j // chunk == i // chunk), (1, l, l))
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return mask


def qkv(l, seed=0, heads=4, kv=2, d=8):
  r = np.random.default_rng(seed)
  return (r.normal(size=(B, l, heads, d)).astype(np.float32),
          r.normal(size=(B, l, kv, d)).astype(np.float32), r.normal(size=(B, l, kv, d)).astype(np.float32))


@pytest.mark.parametrize("impl", ["xla", "fused"])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_attention_is_the_masked_definition(impl, packed):
  """l = 10 in chunks of 4 (the last one short: padding), GQA; with packed segments too.
  The decode cache's generate step at each position gives that position's row."""
  q, k, v = qkv(10)
  seg = np.array([[1] * 6 + [2] * 4, [1] * 10], np.int32) if packed else None
  want = reference_attention(q, k, v, chunk_mask(10, 4, seg))
  opts = AttentionOptions(impl, chunk=4)
  got = jax.jit(lambda q, k, v, s: attn_lib.attend(q, k, v, s, options=opts))(q, k, v, seg)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  if packed:
    return
  positions = np.broadcast_to(np.arange(10), (B, 10))
  step = jax.jit(lambda q1, p: attn_lib.cached_attention(q1, k, v, p, chunk=4))
  for t in range(10):
    np.testing.assert_allclose(step(q[:, t:t + 1], positions[:, t:t + 1])[:, 0], want[:, t],
                               rtol=1e-5, atol=1e-5, err_msg=f"generate step at position {t}")


def test_chunked_attention_on_the_flash_kernel_is_the_definition():
  """The splash kernel (Pallas interpret mode) keeps its static causal mask per chunk."""
  q, k, v = qkv(256, heads=2, kv=1)
  opts = AttentionOptions("flash", chunk=128, interpret=True)
  got = jax.jit(lambda q, k, v: attn_lib.attend(q, k, v, options=opts))(q, k, v)
  np.testing.assert_allclose(got, reference_attention(q, k, v, chunk_mask(256, 128)), rtol=1e-4, atol=1e-4)


def test_nope_layer_with_temperature_tuning_is_the_definition():
  """No rotation of q and k; q scaled by log(floor((pos + 1) / floor) + 1) * scale + 1."""
  with nnx.use_eager_sharding(False):
    layer = attn_lib.Attention(32, 4, 2, 8, rope=False, temperature=(FLOOR, 0.5), rngs=nnx.Rngs(0))
  x = np.random.default_rng(1).normal(size=(B, 16, 32)).astype(np.float32)
  pos = np.broadcast_to(np.arange(16), (B, 16))
  w = lambda m: np.asarray(m.kernel[...], np.float64)
  temp = np.log(np.floor((pos + 1) / FLOOR) + 1) * 0.5 + 1                    # 1 .. 1.8
  q = np.einsum("ble,ehd->blhd", x, w(layer.query)) * temp[..., None, None]
  k, v = (np.einsum("ble,ehd->blhd", x, w(p)) for p in (layer.key, layer.value))
  o = reference_attention(q, k, v, np.tril(np.ones((16, 16), bool))[None])
  want = np.einsum("blhd,hde->ble", o, w(layer.out))
  np.testing.assert_allclose(jax.jit(lambda x, p: layer(x, p))(x, pos), want, rtol=1e-4, atol=1e-4)


def uniform_block(cfg, kind):
  """Layer `kind` as a model without a pattern builds it where it can (window, RoPE base): a
  reference independent of the pattern's plumbing; chunk and NoPE (no uniform form, their
  attention checked above) as a Block of that kind."""
  if kind in (WINDOW, THETA):
    uniform = dataclasses.replace(cfg, layer_pattern=(), attention_window=kind.window,
                                  rope_theta=kind.rope_theta or cfg.rope_theta)
    return Block(uniform, rngs=nnx.Rngs(0))
  return Block(cfg, kind=kind, rngs=nnx.Rngs(0))


def test_pattern_model_is_its_layers_in_order():
  """7 layers = one unit of 4 kinds + a tail of 3: the logits equal embedding, then layer i
  as its kind i % 4 alone (with the model's weights), then the head."""
  graphdef, state = random_state(lambda: TransformerLM(CFG, rngs=nnx.Rngs(0)))
  model = nnx.merge(graphdef, state)
  layers = [b for unit in model.layers.blocks for b in unit.blocks] + list(model.layers.tail.blocks)
  assert len(layers) == 7 and len(model.layers.blocks) == 1
  tokens = np.random.default_rng(2).integers(0, 64, size=(B, L)).astype(np.int32)
  pos = attn_lib.default_positions(B, L)
  with nnx.use_eager_sharding(False):
    refs = [uniform_block(CFG, PATTERN[i % 4]) for i in range(7)]
  for ref, layer in zip(refs, layers):
    nnx.update(ref, nnx.state(layer))

  def by_hand(tokens):
    x = model.embed(tokens)
    for ref in refs:
      x = ref(x, pos)[0]
    return model.logits(x)

  np.testing.assert_allclose(jax.jit(model)(tokens), jax.jit(by_hand)(tokens), rtol=1e-5, atol=1e-5)


MOE = MoEConfig(num_experts=4, d_ff=16, every=2, top_k=2, dispatch="dropless", bias_update_rate=1e-2,
                score="sigmoid")
# MoE every 2 layers, a pattern of 3: units of lcm = 6 layers (3 MoE), 14 layers = 2 units + a tail of 2
MOE_CFG = dataclasses.replace(CFG, num_layers=14, layer_pattern=(WINDOW, CHUNK, NOPE), moe=MOE)


def scanned_params(list_params):
  """A list stack's params in the scanned layout: the units' leaves stacked on a leading dim."""
  params = jax.tree.map(np.asarray, list_params)
  units = params["layers"]["blocks"]
  params["layers"]["blocks"] = jax.tree.map(lambda *u: np.stack(u), *[units[i] for i in sorted(units)])
  return params


def test_scanned_and_remat_stacks_equal_the_list():
  """MoE + pattern: loss, each MoE layer's statistics and the balance-bias updates of the
  scanned stack (plain and remat='full') equal the list's, in layer order."""
  batch_tokens = np.random.default_rng(3).integers(0, 64, size=(B, L + 1)).astype(np.int32)
  batch = {"inputs": batch_tokens[:, :-1], "targets": batch_tokens[:, 1:]}
  graphdef, state = random_state(lambda: TransformerLM(MOE_CFG, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  run = lambda g, p: jax.jit(lambda p, b: nnx.merge(g, p).loss_and_metrics(b))(p, batch)
  loss, metrics = run(graphdef, state)
  assert metrics["moe/routed_copies_count"].shape == (MOE_CFG.num_moe_layers,) == (7,)
  stack = nnx.merge(graphdef, state).layers
  blocks = [b for unit in stack.blocks for b in unit.blocks] + list(stack.tail.blocks)
  moe_layers = [i for i, b in enumerate(blocks) if hasattr(b, "moe")]
  assert moe_layers == [moe_layer(MOE_CFG, u) for u in range(7)] == [1, 3, 5, 7, 9, 11, 13]
  for remat in ("none", "full"):
    cfg = dataclasses.replace(MOE_CFG, scan_layers=True, remat=remat)
    g, s = nnx.split(nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(s, scanned_params(params))
    loss2, metrics2 = run(g, s)
    np.testing.assert_allclose(loss2, loss, rtol=1e-5)
    for key in ("moe/routed_copies_count", "moe/dropped_copies_count", "moe/aux_loss"):
      np.testing.assert_allclose(metrics2[key], metrics[key], rtol=1e-5, err_msg=key)
    updates = scanned_params(metrics[STATE_UPDATES])
    assert len(jax.tree.leaves(updates)) == 4       # the 3 MoE blocks of the unit and the tail's
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), metrics2[STATE_UPDATES], updates)


def decode_logits(model, tokens, prompt):
  """Logits of a prefill of `prompt` tokens, then one generate step per later token."""
  cache = jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype), model.cache_spec(B, L),
                       is_leaf=lambda c: isinstance(c, attn_lib.CacheSpec))
  pos = attn_lib.default_positions(B, L)
  step = jax.jit(lambda m, t, p, c: m.cached(t, p, c))
  logits, cache, dropped = step(model, tokens[:, :prompt], pos[:, :prompt], cache)
  out = [logits]
  for t in range(prompt, L):
    logits, cache, d = step(model, tokens[:, t:t + 1], pos[:, t:t + 1], cache)
    out.append(logits)
    dropped = dropped + d
  return jnp.concatenate(out, axis=1), dropped


@pytest.mark.parametrize("cfg", [CFG, dataclasses.replace(CFG, scan_layers=True),
                                 dataclasses.replace(MOE_CFG, scan_layers=True).for_decode()],
                         ids=["list", "scanned", "moe_scanned"])
def test_decode_with_a_tail_equals_the_full_forward(cfg):
  """Prefill 5 tokens, then generate steps to 12 (past a chunk boundary and the window):
  each step's logits equal the full forward's at that position; nothing dropped."""
  graphdef, state = random_state(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)), seed=4)
  model = nnx.merge(graphdef, state)
  tokens = np.random.default_rng(5).integers(0, 64, size=(B, L)).astype(np.int32)
  got, dropped = decode_logits(model, tokens, prompt=5)
  np.testing.assert_allclose(got, jax.jit(model)(tokens), rtol=2e-5, atol=2e-5)
  assert dropped.shape == (cfg.num_units,) and float(jnp.sum(dropped)) == 0


PATTERN_SET = ["model.layer_pattern=({'window': 3}, {'chunk': 4}, "
               "{'rope': False, 'temperature_tuning': True}, {'rope_theta': 100.0})",
               "model.temperature_floor_scale=4.0"]


@pytest.fixture(scope="module")
def one_device():
  """(params, batch, loss and grads on one device) of the 7-layer pattern model (unit + tail)
  set from the command line's form."""
  exp = tiny_lm(7, 8, extra=PATTERN_SET)
  assert exp.model.layer_pattern == PATTERN and exp.model.num_tail_layers == 3
  graphdef, state = random_state(lambda: TransformerLM(exp.model, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  tokens = np.random.default_rng(6).integers(0, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, _), _ = loss_and_grads(setup_for(exp, jax.devices()[:1]), params, batch)
  return params, batch, loss, grads


@pytest.mark.parametrize("preset,ici", [("fsdp", (8, 1)), ("2d", (2, 4))])
def test_sharded_pattern_model_equals_one_device(one_device, preset, ici):
  """Loss and grads on 8 devices (fsdp, 2d) equal one device's."""
  params, batch, loss1, grads1 = one_device
  (loss8, grads8, _), _ = loss_and_grads(setup_for(tiny_lm(7, 8, ici=ici, preset=preset, extra=PATTERN_SET)),
                                         params, batch)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads8, grads1)


@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_context_parallel_pattern_model_equals_one_device(mode):
  """Windowed, NoPE + temperature and own-base layers (no chunk: refused under context
  parallelism) on (data 2, context 4) with packed rows: loss and grads equal one device's."""
  assert_context_parallel_equals_one_device([
      "model.layer_pattern=({'window': 3}, {'rope': False, 'temperature_tuning': True}, {'rope_theta': 100.0})",
      "model.temperature_floor_scale=4.0", f"model.context_parallel={mode!r}"])


def assert_context_parallel_equals_one_device(overrides):
  """A 4-layer tiny LM with `overrides` and random params on (data 2, context 4) with packed
  rows (3 documents a row): loss and every gradient equal one device's."""
  overrides = [*overrides, "data.source='stdlib'"]
  one = tiny_lm(4, 8, extra=overrides)
  cp = tiny_lm(4, 8, ici=(2, 4), axes=("data", "context"), preset="dp_cp", extra=overrides)
  graphdef, state = random_state(lambda: TransformerLM(one.model, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  batch = packed_batch(np.random.default_rng(8), 8, 16)
  (loss1, grads1, _), _ = loss_and_grads(setup_for(one, jax.devices()[:1]), params, batch)
  (loss8, grads8, _), _ = loss_and_grads(setup_for(cp), params, batch)
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads8, grads1)


def test_pipelined_pattern_model_equals_the_scanned_one():
  """2 stages of 2 units of a 2-kind pattern (chunk, NoPE): the pipelined loss equals the
  scanned stack's on the same weights."""
  kinds = ["model.layer_pattern=({'chunk': 4}, {'rope': False, 'temperature_tuning': True})",
           "model.temperature_floor_scale=4.0"]
  piped = tiny_lm(8, 8, stages=2, micro=2, ici=(2, 4), axes=("stage", "data"), preset="pp_dp", extra=kinds)
  plain = tiny_lm(8, 8, extra=kinds)
  assert piped.model.num_stack_units == 4
  graphdef, state = random_state(lambda: TransformerLM(piped.model, rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  flat = jax.tree.map(np.asarray, params)
  flat["layers"]["blocks"] = jax.tree.map(lambda a: np.asarray(pipeline.from_stages(a)),
                                          flat["layers"]["blocks"])
  tokens = np.random.default_rng(7).integers(0, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss_p, _, _), _ = loss_and_grads(setup_for(piped), params, batch)
  (loss_s, _, _), _ = loss_and_grads(setup_for(plain, jax.devices()[:1]), flat, batch)
  np.testing.assert_allclose(loss_p, loss_s, rtol=1e-5)


@pytest.mark.parametrize("fields,named", [
    (dict(layer_pattern=({"window": 4, "chunk": 4},)), "window and chunk are both set"),
    (dict(layer_pattern=({"rope": False, "rope_theta": 1e4},)), "rope=False (NoPE) with rope_theta"),
    (dict(layer_pattern=({"temperature_tuning": True},)), "temperature_tuning=True on a RoPE layer"),
    (dict(layer_pattern=({"windw": 4},)), "keys among"),
    (dict(layer_pattern=({},), attention_window=4), "model.attention_window=4 with model.layer_pattern"),
    (dict(layer_pattern=({}, {}, {}), num_layers=2), "below one unit"),
    (dict(layer_pattern=({}, {}), moe=MoEConfig(first_dense_layers=1, every=1)), "first_dense_layers=1"),
    (dict(layer_pattern=({}, {}), num_layers=5, pipeline=PipelineConfig(stages=2, microbatches=2)),
     "leaves a tail of 1"),
])
def test_bad_patterns_are_refused_by_name(fields, named):
  with pytest.raises(ConfigError, match=re.escape(named)):
    TransformerConfig(**fields)


def test_chunked_attention_with_context_parallelism_is_refused_by_name():
  """Rules that split `length` (context parallelism) on a (data 2, context 4) mesh."""
  with nnx.use_eager_sharding(False):
    layer = attn_lib.Attention(32, 4, 4, 8, options=AttentionOptions(chunk=4), rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh), use_rules((("batch", "data"), ("length", "context"))):
    with pytest.raises(ValueError, match="chunked attention .* with context parallelism"):
      jax.jit(lambda x: layer(x)).lower(jnp.zeros((B, 8, 32)))
