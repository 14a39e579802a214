"""Attention sinks (gpt-oss) on every attention path: the XLA einsums, chunked layers, context
parallelism (allgather and ring), refused by name where a kernel has no sink; and a tiny
gpt-oss-shaped LM (sinks, a sliding/full pattern, router and expert biases, the clamped SwiGLU)
whose sharded runs (expert parallel, context-parallel ring) equal one device's."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshtools import loss_and_grads, setup_for  # noqa: E402

from shardax import configs  # noqa: E402
from shardax.configs.attention import AttentionOptions  # noqa: E402
from shardax.configs.schema import ConfigError  # noqa: E402
from shardax.layers import context_parallel as cp  # noqa: E402
from shardax.layers.attention import attention_core, xla_attention  # noqa: E402
from shardax.layers.attention_choice import resolve  # noqa: E402
from shardax.sharding import use_rules  # noqa: E402
from shardax.trainer import state as state_lib  # noqa: E402


def _qkv(shape, seed=0):
  b, l, n, kv, d = shape
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, l, n, d))
  k, v = (jax.random.normal(key, (b, l, kv, d)) for key in ks[1:3])
  sinks = jax.random.normal(ks[3], (n,)) * 2.0
  return q, k, v, sinks


def test_sinks_are_a_logit_of_no_value_in_each_heads_softmax():
  """xla attention with sinks = transformers' definition: the sink appended to each row's
  masked logits, softmax, the sink's column dropped; sinks at -1e30 are no sinks at all."""
  q, k, v, sinks = _qkv((2, 9, 4, 2, 8))
  got = xla_attention(q, k, v, window=4, sinks=sinks)
  qg = np.asarray(q).reshape(2, 9, 2, 2, 8)
  logits = np.einsum("bqkgd,bskd->bkgqs", qg, np.asarray(k)) / np.sqrt(8)
  i, j = np.arange(9)[:, None], np.arange(9)[None]
  logits = np.where((j <= i) & (i - j < 4), logits, -np.inf)
  sink = np.broadcast_to(np.asarray(sinks).reshape(1, 2, 2, 1, 1), logits.shape[:-1] + (1,))
  full = np.concatenate([logits, sink], axis=-1)
  probs = np.exp(full - full.max(-1, keepdims=True))
  probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
  want = np.einsum("bkgqs,bskd->bqkgd", probs, np.asarray(v)).reshape(2, 9, 4, 8)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(got) - np.asarray(xla_attention(q, k, v, window=4))).max() > 1e-2
  np.testing.assert_allclose(xla_attention(q, k, v, window=4, sinks=jnp.full((4,), -1e30)),
                             xla_attention(q, k, v, window=4), rtol=1e-6, atol=1e-6)


def test_sinks_pass_through_chunked_attention():
  """A chunked layer kind folds chunks into the batch; each chunk's softmax still has the sink."""
  q, k, v, sinks = _qkv((1, 8, 4, 2, 8))
  got = attention_core(q, k, v, options=AttentionOptions("xla", chunk=4), sinks=sinks)
  for c in range(2):
    part = slice(4 * c, 4 * c + 4)
    np.testing.assert_allclose(got[:, part], xla_attention(q[:, part], k[:, part], v[:, part], sinks=sinks),
                               rtol=1e-5, atol=1e-6)


def test_kernels_without_a_sink_are_refused_by_name():
  q, k, v, sinks = _qkv((1, 128, 2, 1, 128))
  for impl in ("flash", "fused"):
    with pytest.raises(ValueError, match="attention sinks"):
      attention_core(q, k, v, options=AttentionOptions(impl, sinks=True), sinks=sinks)
  assert resolve(AttentionOptions("auto", sinks=True), 128, 128) == "xla"
  for change in ("model.attention='flash'", "model.attention='fused'"):
    cfg = configs.get("lm.tiny")
    configs.apply_overrides(cfg, ["model.attention_sinks=True", change])
    with pytest.raises(ConfigError, match="attention_sinks"):
      configs.build(cfg)


@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_context_parallel_with_sinks_equals_one_device(mode):
  """The sink merged once into the running softmax statistics: output and the gradients of
  q, k, v and the sinks equal the single-device einsum attention (balanced order, 3 packed
  documents a row, a window of 5 across chunk boundaries, data 2 x context 4)."""
  b, l = 2, 32
  q, k, v, sinks = _qkv((b, l, 4, 2, 8), seed=1)
  cot = jax.random.normal(jax.random.key(9), q.shape)
  row = np.repeat(np.arange(1, 4), np.diff([0, 12, 24, l]))
  seg = jnp.asarray(np.stack([np.roll(row, 7 * r) for r in range(b)]), jnp.int32)
  opts = AttentionOptions("xla", window=5, sinks=True)
  mesh = jax.make_mesh((2, 4), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def sharded(q, k, v, s):
    with cp.sequence(mode, True):
      args = [cp.balance(t, 4) for t in (q, k, v, seg)]
      return cp.unbalance(cp.attention(*args, options=opts, sinks=s), 4)

  def one(q, k, v, s):
    return xla_attention(q, k, v, seg, window=5, sinks=s)

  def out_and_grads(f):
    out, vjp = jax.vjp(f, q, k, v, sinks)
    return out, vjp(cot)

  with jax.set_mesh(mesh), use_rules((("batch", "data"), ("length", "context"))):
    out, grads = jax.jit(lambda: out_and_grads(sharded))()
  want, want_grads = out_and_grads(one)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
  assert float(jnp.max(jnp.abs(want_grads[3]))) > 1e-3   # the sinks get a gradient


# ---------------------------------------------------------------------------------- the LM

GPT_OSS_TINY = [
    "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.d_ff=32",
    "model.max_len=16", "data.seq_len=16", "train.global_batch=8", "data.source='synthetic'",
    "model.attention_sinks=True", "model.qkv_bias=True", "model.out_bias=True", "model.scale_embedding=False",
    "model.layer_pattern=({'window': 5}, {})", "model.moe.every=1", "model.moe.num_experts=8",
    "model.moe.d_ff=16", "model.moe.dispatch='dropless'", "model.moe.top_k=2", "model.moe.router_bias=True",
    "model.moe.expert_bias=True", "model.moe.swiglu_limit=0.5", "model.moe.aux_loss_pooling='over_layers'"]
SHARDED = {"expert": ((8,), ("data",), "expert", "allgather"),
           "ring_dp2_cp4": ((2, 4), ("data", "context"), "dp_cp", "ring")}


def _tiny(ici, axes, preset, mode):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, GPT_OSS_TINY + [f"mesh.ici={ici!r}", f"mesh.axes={axes!r}",
                                               f"sharding.preset={preset!r}", f"model.context_parallel={mode!r}"])
  return configs.build(cfg)


@pytest.fixture(scope="module")
def reference_run():
  """One device: params with random sinks, router and expert biases; loss, grads, metrics."""
  setup = setup_for(_tiny((1,), ("data",), "dp", "allgather"), jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  rng = np.random.default_rng(0)

  def randomized(path, a):
    name = jax.tree_util.keystr(path)
    if name.endswith(("['sinks']", "_bias']", "['router']['bias']")):
      return rng.normal(size=a.shape).astype(a.dtype)
    return a
  params = jax.tree_util.tree_map_with_path(randomized, params)
  tokens = rng.integers(1, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  return setup, params, batch, float(loss), jax.device_get(grads)


@pytest.mark.parametrize("case", list(SHARDED))
def test_tiny_gpt_oss_sharded_equals_one_device(case, reference_run):
  """Sinks, a sliding/full pattern, router and expert biases and the clamp on an expert-parallel
  mesh (8 expert shards, dropless all-to-all) and a context-parallel ring (data 2 x context 4):
  loss and every gradient equal one device's; the sinks' and biases' gradients are not 0."""
  _, params, batch, ref_loss, ref_grads = reference_run
  setup = setup_for(_tiny(*SHARDED[case]))
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  flat, want = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(want)
  for (path, g), r in zip(flat, want):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=f"{case} {jax.tree_util.keystr(path)}")
  named = {jax.tree_util.keystr(p): np.abs(np.asarray(g)).max() for p, g in flat}
  for end in ("['sinks']", "['wi_gate_bias']", "['wo_bias']", "['router']['bias']"):
    assert min(v for k, v in named.items() if k.endswith(end)) > 1e-6, end


def test_sinks_change_the_loss(reference_run):
  """The same params with the sinks at -1e30 (no sink): a different loss, so the test above
  compares runs in which the sinks take part."""
  setup, params, batch, ref_loss, _ = reference_run
  off = jax.tree_util.tree_map_with_path(
      lambda p, a: np.full_like(a, -1e30) if jax.tree_util.keystr(p).endswith("['sinks']") else a, params)
  (loss, _, _), _ = loss_and_grads(setup, off, batch)
  assert abs(float(loss) - ref_loss) > 1e-3


@pytest.mark.slow   # ~40-100 s on 2 shared cores: a pipelined compile
def test_tiny_gpt_oss_pipelined_equals_accumulation_on_one_device():
  """4 layers (2 units of a sliding and a full layer) through 2 pipeline stages x 4 microbatches
  with the experts split 4 ways (pp_expert) equal one device accumulating 4 microbatches: the
  sinks and expert biases ride in the stage-stacked params (per-layer balance loss: a pooled one
  is per step, not per microbatch)."""
  from shardax import pipeline
  extra = ["model.num_layers=4", "model.moe.aux_loss_pooling='per_layer'", "train.global_batch=16"]

  def build(ici, axes, preset, stages, accum):
    cfg = configs.get("moe.tiny")
    configs.apply_overrides(cfg, GPT_OSS_TINY + extra + [
        f"mesh.ici={ici!r}", f"mesh.axes={axes!r}", f"sharding.preset={preset!r}",
        f"model.pipeline.stages={stages}", f"model.pipeline.microbatches={4 if stages > 1 else 1}",
        f"train.microbatches={accum}"])
    return configs.build(cfg)
  ref = setup_for(build((1,), ("data",), "dp", 1, 4), jax.devices()[:1])
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda p, a: rng.normal(size=a.shape).astype(a.dtype)
      if jax.tree_util.keystr(p).endswith(("['sinks']", "_bias']", "['bias']")) else a,
      jax.device_get(state_lib.init_fn(ref)(jax.random.key(0))["params"]))
  tokens = rng.integers(1, 256, size=(16, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, _), _ = loss_and_grads(ref, params, batch)
  setup = setup_for(build((2, 4), ("stage", "data"), "pp_expert", 2, 1))
  staged = dict(params, layers=dict(params["layers"], blocks=pipeline.stage_params(params["layers"]["blocks"], 2, 1)))
  (p_loss, p_grads, _), _ = loss_and_grads(setup, staged, batch)
  p_grads = jax.device_get(p_grads)
  p_grads["layers"]["blocks"] = pipeline.unstage_params(p_grads["layers"]["blocks"], 1)
  np.testing.assert_allclose(float(p_loss), float(loss), rtol=1e-5)
  for (path, g), r in zip(jax.tree.leaves_with_path(p_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
