"""Cached decoding: the same tokens as full forward passes, on one device and sharded."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from shardax import configs, models
from shardax.sharding import make_mesh
from shardax.trainer import decode, decode_cache
from shardax.trainer import state as state_lib

PROMPT_LENGTHS = (3, 11, 1, 17, 6, 9, 2, 14)   # a batch of 8, different lengths
NEW = 12

SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.d_ff=128",
         "model.max_len=64", "data.seq_len=32", "train.global_batch=8", "data.source='synthetic'"]
GQA = ["model.num_heads=8", "model.num_kv_heads=4"]   # 2 query heads per kv head


def experiment(*overrides, name="lm.tiny"):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, list(overrides))
  return configs.build(cfg)


def params_of(exp, seed=0, scale=2.0):
  """Params initialized on one device, unsharded (the same numbers for every mesh), times
  `scale`: at init scale a model's next token hardly depends on the context (it repeats
  one token), so a broken mask or cache would go unnoticed; doubled weights give sharp
  attention and varied, context-dependent tokens."""
  from flax import nnx
  make = lambda key: nnx.to_pure_dict(nnx.state(models.build(exp.model, nnx.Rngs(params=key)), nnx.Param))
  with nnx.use_eager_sharding(False):
    return jax.device_get(jax.tree.map(lambda a: a * scale, jax.jit(make)(jax.random.key(seed))))


def generator(exp, params, devices=None, **kw):
  """A Generator on exp's mesh (built from `devices`) with params placed as the rules say."""
  setup = state_lib.create(exp, make_mesh(exp.mesh, devices))
  params = jax.device_put(params, setup.shardings["params"])
  return decode.Generator(exp.model, params, setup.mesh, setup.rules, **kw)


def prompts(vocab=256, seed=1):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, size=n).astype(np.int32) for n in PROMPT_LENGTHS]


def assert_greedy_matches_full_forward(exp, params, batch, new_ids):
  """Each new id is the argmax of a full forward pass over the prompt and the ids before
  it: one teacher-forced pass over [prompt + new ids] (causal, so position i sees
  exactly the tokens <= i) gives all those passes' last logits at once."""
  model_cfg = decode_cache.decode_config(exp.model)
  width = max(p.size for p in batch) + NEW
  seqs = np.zeros((len(batch), width), np.int32)
  for i, (p, new) in enumerate(zip(batch, new_ids)):
    seqs[i, :p.size + NEW] = np.concatenate([p, new])
  from flax import nnx
  graphdef = nnx.split(nnx.eval_shape(lambda: models.build(model_cfg, nnx.Rngs(0))), nnx.Param, ...)[0]
  logits = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, seqs))
  for i, p in enumerate(batch):
    want = logits[i, p.size - 1:p.size - 1 + NEW].argmax(-1)
    np.testing.assert_array_equal(new_ids[i], want, err_msg=f"row {i} (prompt of {p.size})")


@pytest.fixture(scope="module")
def mha():
  """(exp, params, one-device generator) shared by the tests below (one compile each)."""
  exp = experiment(*SMALL, "mesh.ici=(1, 1)")
  params = params_of(exp)
  return exp, params, generator(exp, params, jax.devices()[:1])


@pytest.fixture(scope="module")
def greedy(mha):
  return mha[2].run(prompts(), decode.Sampling(max_new_tokens=NEW))


def test_greedy_cached_decode_equals_full_forward_argmax(mha, greedy):
  exp, params, _ = mha
  assert greedy.steps == NEW and (greedy.counts == NEW).all() and not greedy.stopped.any()
  assert_greedy_matches_full_forward(exp, params, prompts(), greedy.ids)


def test_sharded_2d_decode_equals_one_device(mha, greedy):
  """(2, 4) mesh, 2d preset: batch and cache over data, heads and kv heads over model."""
  exp = experiment(*SMALL, "mesh.ici=(2, 4)", "sharding.preset='2d'")
  sharded = generator(exp, mha[1]).run(prompts(), decode.Sampling(max_new_tokens=NEW))
  np.testing.assert_array_equal(sharded.ids, greedy.ids)


def test_gqa_on_2x4_matches_full_forward_and_its_cache_is_sharded_by_the_rules():
  """Grouped-query (8 heads, 4 kv heads) on (2, 4) with 2d: tokens equal the full forward
  argmax; the cache the compiled prefill returns is split as the rules give, and its
  bytes (in all and per device) are the formula's."""
  exp = experiment(*SMALL, *GQA, "mesh.ici=(2, 4)", "sharding.preset='2d'")
  params = params_of(exp)
  gen = generator(exp, params)
  batch = prompts()
  out = gen.run(batch, decode.Sampling(max_new_tokens=NEW))
  assert_greedy_matches_full_forward(exp, params, batch, out.ids)

  tokens, lengths = gen.padded(batch, NEW)
  rows, length = tokens.shape                      # 8 rows, 24 prompt slots + 12 new
  cache, _ = gen.prefill(tokens, lengths, NEW)
  leaves = jax.tree.leaves(cache)
  assert len(leaves) == 2  # k and v of the scanned stack: [layers, batch, length, kv_heads, kv]
  L, kv, d = 2, 4, 64 // 8
  want = PartitionSpec(None, "data", None, "model", None)   # 2d: batch -> data, kv heads -> model
  for a in leaves:
    assert a.shape == (L, rows, length, kv, d)
    assert a.sharding.spec == want, a.sharding
    assert a.addressable_shards[0].data.shape == (L, rows // 2, length, kv // 4, d)
  assert decode_cache.cache_bytes(gen.cache_spec(rows, length)) == 2 * L * rows * length * kv * d * 4
  per_device = sum(a.addressable_shards[0].data.nbytes for a in leaves)
  assert per_device == 2 * L * (rows // 2) * length * (kv // 4) * d * 4


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(mha, greedy):
  gen = mha[2]
  batch = prompts()
  hot = decode.Sampling(temperature=1.5, top_p=0.95, max_new_tokens=NEW, seed=7)
  a, b = gen.run(batch, hot), gen.run(batch, hot)
  np.testing.assert_array_equal(a.ids, b.ids)
  other = gen.run(batch, dataclasses.replace(hot, seed=8))
  assert (other.ids != a.ids).any()
  assert (a.ids != greedy.ids).any()
  top1 = gen.run(batch, decode.Sampling(temperature=1.5, top_k=1, max_new_tokens=NEW, seed=7))
  np.testing.assert_array_equal(top1.ids, greedy.ids)


def test_top_k_and_top_p_keep_the_right_tokens():
  logits = jax.numpy.log(jax.numpy.asarray([[0.5, 0.3, 0.15, 0.05]]))
  kept = lambda s: np.isfinite(np.asarray(decode.filter_logits(logits, s)))[0].tolist()
  assert kept(decode.Sampling(temperature=1.0, top_k=2)) == [True, True, False, False]
  assert kept(decode.Sampling(temperature=1.0, top_p=0.8)) == [True, True, False, False]
  assert kept(decode.Sampling(temperature=1.0, top_p=0.81)) == [True, True, True, False]
  assert kept(decode.Sampling(temperature=1.0, top_p=0.3)) == [True, False, False, False]
  with pytest.raises(ValueError, match="top_p"):
    decode.Sampling(top_p=0.0)


def test_stop_tokens_end_rows_and_uncached_decode_agrees(mha, greedy):
  exp, params, gen = mha
  batch = prompts()
  free = greedy
  free = gen.run(batch, decode.Sampling(max_new_tokens=NEW))
  stop = int(free.ids[0, 4])                    # row 0's fifth token
  first = [int(np.argmax(r == stop)) if (r == stop).any() else None for r in free.ids]
  done = gen.run(batch, decode.Sampling(max_new_tokens=NEW, stop_tokens=(stop,)))
  for i, at in enumerate(first):
    if at is None:
      assert not done.stopped[i] and done.counts[i] == NEW
    else:
      assert done.stopped[i] and done.counts[i] == at + 1
      np.testing.assert_array_equal(done.ids[i, :at + 1], free.ids[i, :at + 1])
      assert (done.ids[i, at + 1:] == decode.PAD_ID).all()
  uncached = decode.Generator(exp.model, params, use_cache=False)   # no mesh at all
  again = uncached.run(batch, decode.Sampling(max_new_tokens=NEW, stop_tokens=(stop,)))
  np.testing.assert_array_equal(again.ids, done.ids)


@pytest.mark.parametrize("moe", [[], ["model.moe.num_experts=4", "model.moe.d_ff=64", "model.moe.every=1",
                                      "model.moe.dispatch='dropless'"]], ids=["dense", "moe"])
def test_pipelined_model_decodes_its_stages_in_order(moe):
  exp = experiment(*SMALL, "model.pipeline.stages=2", "model.pipeline.microbatches=4", *moe,
              name="lm.tiny_pipelined")
  params = params_of(exp)
  batch = prompts()
  out = generator(exp, params).run(batch, decode.Sampling(max_new_tokens=NEW))  # (stage 2, data 4)
  assert_greedy_matches_full_forward(exp, params, batch, out.ids)


def test_unscanned_layers_decode_with_a_cache_per_block():
  exp = experiment(*SMALL, "model.scan_layers=False", "mesh.ici=(1, 1)")
  params = params_of(exp)
  gen = generator(exp, params, jax.devices()[:1])
  assert isinstance(gen.cache_spec(8, 16), list)   # one {'k', 'v'} per block
  out = gen.run(prompts(), decode.Sampling(max_new_tokens=NEW))
  assert_greedy_matches_full_forward(exp, params, prompts(), out.ids)


def test_moe_decodes_without_dropping_tokens():
  t = ["model.num_layers=2", "model.d_model=64",
       "model.num_heads=4", "model.d_ff=128",
       "model.max_len=64", "model.moe.d_ff=64", "model.moe.capacity_factor=0.5",
       "data.seq_len=32", "train.global_batch=8", "data.source='synthetic'"]
  exp = experiment(*t, "mesh.ici=(8, 1)", name="moe.tiny")
  params = params_of(exp)
  batch = prompts()
  out = generator(exp, params).run(batch, decode.Sampling(max_new_tokens=NEW))
  assert_greedy_matches_full_forward(exp, params, batch, out.ids)
  assert decode_cache.decode_config(exp.model).moe.capacity(32) == 32   # capacity = group: no drops


def test_prompts_file_jsonl_and_text(tmp_path):
  j = tmp_path / "p.jsonl"
  j.write_text('{"prompt": "def f("}\n\n"import os\\n"\n')
  assert decode.read_prompts(str(j)) == ["def f(", "import os\n"]
  t = tmp_path / "p.txt"
  t.write_text("class A:\nfor i in\n")
  assert decode.read_prompts(str(t)) == ["class A:", "for i in"]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": 1}\n')
  with pytest.raises(ValueError, match="bad.jsonl:1"):
    decode.read_prompts(str(bad))


def test_explain_line_reports_the_cache_bytes_per_device():
  exp = experiment(*SMALL, *GQA, "mesh.ici=(2, 4)", "sharding.preset='2d'")
  mesh = make_mesh(exp.mesh)
  from shardax.sharding import rules as rules_lib
  line = decode_cache.cache_summary(exp, mesh, rules_lib.resolve("2d"))
  total = 2 * 2 * 8 * 64 * 4 * 8 * 4            # k+v, layers, rows, max_len slots, kv heads, d, f32
  assert f"{total:,} bytes, {total // 8:,} per device" in line, line
  assert "P(None, 'data', None, 'model', None)" in line


def test_prompt_plus_new_tokens_past_max_len_is_refused(mha):
  """Positions past model.max_len (64 here) decode garbage: refused, naming both numbers."""
  gen = mha[2]
  with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(5\) = 65 exceeds model.max_len=64"):
    gen.run([np.arange(1, 61, dtype=np.int32)], decode.Sampling(max_new_tokens=5))
  tokens, lengths = gen.padded([np.arange(1, 61, dtype=np.int32)], 4)   # 64: the last position fits
  assert lengths[0] == 60
