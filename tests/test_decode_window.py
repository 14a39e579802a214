"""Bounded decode caches: windowed and chunked layers keep a ring of window (chunk) slots
(layers/attention.py `write_ring`), and decoding on them computes what the full-length cache
computes, on one device and sharded; the cache's size is the window's, not the decode length's.

Ring against full cache: equal within float32 rounding, not bit for bit. The ring holds the same
keys in another slot order and R instead of S slots, so the softmax's sum and the contraction of
probabilities with values add the same terms in another order: one attention layer's outputs
agree within 1e-6; a whole model's logits (the rounding carried through the layers, norms and
head) within 4e-6 of the largest logit's magnitude (~1e-5 at the fixtures' logits of up to 10).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax import configs, models
from shardax.configs.attention import AttentionOptions
from shardax.layers.attention import Attention, CacheSpec, kv_cache_spec
from shardax.sharding import make_mesh
from shardax.sharding import rules as rules_lib
from shardax.trainer import decode, decode_cache
from test_decode import NEW, SMALL, assert_greedy_matches_full_forward, experiment, generator, params_of, prompts
from test_layers import random_state

WINDOW, CHUNK = 4, 4
MODELS = {   # a local + global pattern (3 layers: a unit of 2, a local tail); Llama 4's chunks + NoPE
    "window": [f"model.layer_pattern=({{'window': {WINDOW}}}, {{}})", "model.num_layers=3"],
    "chunk": [f"model.layer_pattern=({{'chunk': {CHUNK}}}, {{'rope': False, 'temperature_tuning': True}})",
              "model.num_layers=3", "model.temperature_floor_scale=2.0"],
}
LENGTHS = np.asarray((13, 3, 9, 1), np.int32)   # prompts shorter and longer than the window


def is_leaf(c):
  return isinstance(c, CacheSpec)


def stepped(call, spec, tokens, lengths):
  """[steps + 1, rows, ...]: `call(tokens, positions, cache) -> (out, cache)` on a prefill of the
  right-padded block of the longest prompt (row b's prompt: its first lengths[b] tokens; the
  out of its last prompt token), then on one teacher-forced generate step per later position
  (lengths + t) up to the width of `tokens`; one compiled program (the steps scanned)."""
  rows, width = tokens.shape[:2]
  prompt = int(lengths.max())
  index = jnp.arange(rows)

  def run(tokens, lengths):
    cache = jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype), spec, is_leaf=is_leaf)
    out, cache = call(tokens[:, :prompt], decode_cache.prefill_positions((rows, prompt), lengths), cache)

    def step(cache, t):
      at = lengths + t
      out, cache = call(tokens[index, at][:, None], at[:, None], cache)
      return cache, out[:, 0]
    _, outs = jax.lax.scan(step, cache, jnp.arange(width - prompt))
    return jnp.concatenate([out[index, lengths - 1][None], outs])

  return np.asarray(jax.jit(run)(jnp.asarray(tokens), jnp.asarray(lengths)))


def assert_within_rounding(ring, full):
  """Logits of a ring decode within 4e-6 x the largest |logit| of the full cache's."""
  np.testing.assert_allclose(ring, full, rtol=0, atol=4e-6 * float(np.abs(full).max()))


def ring_and_full(call, make_spec, tokens, lengths):
  """`stepped` on the bounded spec (rings) and on the full-length one."""
  return tuple(stepped(call, make_spec(bounded), tokens, lengths) for bounded in (True, False))


@pytest.mark.parametrize("mask", [dict(window=WINDOW), dict(chunk=CHUNK)], ids=["window", "chunk"])
def test_attention_layer_on_a_ring_equals_the_full_cache(mask):
  """One GQA layer with sinks and a soft-cap: every step's output on a ring of 4 slots is the
  full cache's within 1e-6 (absolute and relative), for rows padded before the window and past
  it (30 positions)."""
  opts = AttentionOptions("xla", softcap=20.0, sinks=True, **mask)
  graphdef, state = random_state(lambda: Attention(32, 4, 2, 8, options=opts, rngs=nnx.Rngs(0)), seed=1)
  layer = nnx.merge(graphdef, state)
  x = np.random.default_rng(2).normal(size=(4, 30, 32)).astype(np.float32)
  call = lambda x, p, c: layer.cached(x, p, c)
  spec = lambda bounded: kv_cache_spec(4, 30, 2, 8, jnp.float32, (mask.get("window") or mask["chunk"]) if bounded else None)
  assert spec(True)["k"].shape == (4, 4, 2, 8) and spec(True)["held"].shape == (4, 4)
  ring, full = ring_and_full(call, spec, x, LENGTHS)
  assert np.abs(full).max() > 0.5
  np.testing.assert_allclose(ring, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ring_decode_steps_equal_the_full_cache_and_the_forward(name):
  """A tiny LM with random weights: each generate step's logits on the rings within rounding of
  the full-length cache's (`assert_within_rounding`), within 2e-5 of the full forward's (argmax equal),
  4 padded rows, 30 positions."""
  exp = experiment(*SMALL, *MODELS[name], "mesh.ici=(1, 1)")
  graphdef, state = random_state(lambda: models.build(exp.model, nnx.Rngs(0)), seed=4)
  model = nnx.merge(graphdef, state)
  tokens = np.random.default_rng(0).integers(1, 256, size=(4, 30)).astype(np.int32)
  ring, full = ring_and_full(lambda t, p, c: model.cached(t, p, c)[:2],
                             lambda bounded: model.cache_spec(4, 30, bounded), tokens, LENGTHS)
  forward = np.asarray(jax.jit(lambda t: model(t))(tokens))
  forward = np.stack([forward[np.arange(4), LENGTHS - 1 + t] for t in range(len(ring))])
  assert_within_rounding(ring, full)
  np.testing.assert_allclose(ring, forward, rtol=0, atol=2e-5)
  np.testing.assert_array_equal(ring.argmax(-1), forward.argmax(-1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_ring_decode_equals_the_full_cache_one_device_and_sharded(name):
  """Prompts of 1..17 tokens (padded to 24) and 12 new ones: the ring decode on one device makes
  the full-length cache's tokens and the full forward's argmax; on (2, 4) with the 2d rules the
  same tokens, its rings [layers, rows, 4, kv, d] split as the rules split the cache."""
  exp = experiment(*SMALL, *MODELS[name], "mesh.ici=(1, 1)")
  params = params_of(exp)
  batch, greedy = prompts(), decode.Sampling(max_new_tokens=NEW)
  one = generator(exp, params, jax.devices()[:1]).run(batch, greedy)
  full = generator(exp, params, jax.devices()[:1], bounded_cache=False).run(batch, greedy)
  np.testing.assert_array_equal(one.ids, full.ids)
  assert_greedy_matches_full_forward(exp, params, batch, one.ids)
  sharded = generator(experiment(*SMALL, *MODELS[name], "mesh.ici=(2, 4)", "sharding.preset='2d'"), params)
  np.testing.assert_array_equal(sharded.run(batch, greedy).ids, one.ids)
  tokens, lengths = sharded.padded(batch, NEW)
  cache, _ = sharded.prefill(tokens, lengths, NEW)
  rings = [a for a in jax.tree.leaves(cache) if a.ndim == 5 and a.shape[2] == WINDOW]
  assert rings and all(a.sharding.spec[1] == "data" and a.sharding.spec[3] == "model" for a in rings)


def test_uniform_window_caches_every_layer_in_a_ring():
  """Mistral's one model.attention_window: every layer's cache is a ring of window slots."""
  exp = experiment(*SMALL, f"model.attention_window={WINDOW}", "mesh.ici=(1, 1)")
  model = nnx.eval_shape(lambda: models.build(exp.model, nnx.Rngs(0)))
  spec = model.cache_spec(8, 36)
  assert {k: c.shape for k, c in spec.items()} == {"k": (2, 8, WINDOW, 4, 16), "v": (2, 8, WINDOW, 4, 16),
                                                   "held": (2, 8, WINDOW)}


def test_local_layer_cache_is_window_sized_and_explain_says_the_bytes_per_sequence():
  """lm.gemma3_27b at 32k positions: its 52 local layers cache 1024 slots, its 10 global ones
  32768; the explain line gives the bytes of one sequence's cache with and without the rings,
  from the specs."""
  cfg = configs.get("lm.gemma3_27b")
  configs.apply_overrides(cfg, ["model.max_len=32768", "mesh.ici=(8, 1)", "mesh.topology=None",
                                "train.global_batch=8"])
  exp = configs.build(cfg)
  model = nnx.eval_shape(lambda: models.build(decode_cache.decode_config(exp.model), nnx.Rngs(0)))
  spec = model.cache_spec(1, 32768)
  layers = {}   # k and v arrays per slot count, stacked layers counted one by one
  for c in jax.tree.leaves(spec, is_leaf=is_leaf):
    if c.axes[-1] == "kv":
      layers[c.shape[-3]] = layers.get(c.shape[-3], 0) + (c.shape[0] if len(c.shape) == 5 else 1)
  assert layers == {1024: 2 * 52, 32768: 2 * 10}, layers
  ring, full = decode_cache.cache_bytes(spec), decode_cache.cache_bytes(model.cache_spec(1, 32768, bounded=False))
  assert ring < full / 4
  line = decode_cache.cache_summary(exp, make_mesh(exp.mesh), rules_lib.resolve("fsdp"))
  assert f"per sequence {ring:,} bytes ({full:,} with 32768 slots on every layer)" in line, line
