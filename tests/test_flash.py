"""Flash attention (layers/flash.py) against the einsum path, and what a TPU compile holds.

The splash kernel runs here in Pallas interpret mode (the kernel's own program, executed
by the CPU), so these compare the real kernel's numerics with `xla_attention`:
  float32 inputs: outputs within 2e-5, gradients within 1e-4 (relative to the largest
  entry of each gradient): the kernel's online softmax sums in another order;
  bfloat16 inputs: outputs within 2e-2 (one bf16 ulp near 1 is 8e-3; q is scaled in bf16
  by the kernel path, in float32 logits by the einsum path).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.layers import flash
from shardax.layers.attention import AttentionOptions, attend, attention_core, xla_attention
from shardax.sharding import rules as rules_lib, use_rules

B, L, N, KV, D = 2, 256, 4, 2, 128          # GQA: 2 query heads per kv head; 2 x 2 kernel blocks
FLASH = AttentionOptions("flash", flash_block_q=128, flash_block_kv=128, interpret=True)


def _qkv(dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, L, N, D), dtype), jax.random.normal(ks[1], (B, L, KV, D), dtype),
          jax.random.normal(ks[2], (B, L, KV, D), dtype))


def _three_docs():
  """Three packed documents per row, boundaries inside kernel blocks (not at 128)."""
  row = np.concatenate([np.full(100, 1), np.full(90, 2), np.full(66, 3)])
  return jnp.asarray(np.stack([row, np.roll(row, 7)]), jnp.int32)


def _compare(options, segment_ids):
  q, k, v = _qkv()
  ref = lambda q, k, v: xla_attention(q, k, v, segment_ids, window=options.window, softcap=options.softcap)
  ker = lambda q, k, v: attention_core(q, k, v, segment_ids, options=options)
  out, want = jax.jit(ker)(q, k, v), ref(q, k, v)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)
  cot = jax.random.normal(jax.random.key(9), want.shape)
  loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) * cot))
  got = jax.jit(jax.grad(loss(ker), argnums=(0, 1, 2)))(q, k, v)
  exp = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
  for name, g, e in zip("qkv", got, exp):
    scale = float(jnp.max(jnp.abs(e)))
    assert float(jnp.max(jnp.abs(g - e))) <= 1e-4 * scale, (name, float(jnp.max(jnp.abs(g - e))), scale)


def test_kernel_equals_einsum_causal_packed_gqa_with_gradients():
  _compare(FLASH, _three_docs())


def test_kernel_equals_einsum_with_window_and_softcap():
  opts = AttentionOptions("flash", window=48, softcap=5.0, flash_block_q=128, flash_block_kv=128, interpret=True)
  _compare(opts, _three_docs())


def test_kernel_in_bfloat16_within_a_bf16_step():
  q, k, v = _qkv(jnp.bfloat16, seed=3)
  seg = _three_docs()
  out = jax.jit(lambda q, k, v: attention_core(q, k, v, seg, options=FLASH))(q, k, v)
  want = xla_attention(q, k, v, seg)
  np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), atol=2e-2, rtol=0)


def test_einsum_window_and_softcap_mean_what_they_say():
  q, k, v = _qkv(seed=1)
  # window 1: each query sees only its own key -> the output is its own value (per kv group)
  out = xla_attention(q, k, v, window=1)
  np.testing.assert_allclose(out, jnp.repeat(v, N // KV, axis=2), atol=1e-6)
  np.testing.assert_allclose(xla_attention(q, k, v, window=L), xla_attention(q, k, v), atol=1e-6)
  # a huge cap is no cap; a small one flattens the attention towards a causal average
  np.testing.assert_allclose(xla_attention(q, k, v, softcap=1e6), xla_attention(q, k, v), atol=1e-5)
  flat = xla_attention(q, k, v, softcap=1e-4)
  mean = jnp.cumsum(v, axis=1) / jnp.arange(1, L + 1)[None, :, None, None]
  np.testing.assert_allclose(flat, jnp.repeat(mean, N // KV, axis=2), atol=1e-3)


@pytest.mark.parametrize("rules", [
    (("batch", "data"), ("heads", "model"), ("kv_heads", "model")),  # kv heads split with q heads
    (("batch", "data"), ("heads", "model")),                         # kv heads whole: repeated to q's
])
def test_sharded_kernel_equals_one_device(rules):
  """shard_map runs the kernel on each device's examples and heads (batch over data, heads
  over model); the result is the unsharded einsum's."""
  q, k, v = _qkv(seed=2)
  seg = _three_docs()
  shape = (2, 2) if len(rules) == 3 else (2, 4)    # 2 kv heads split over 2, 4 q heads over 4
  mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:shape[0] * shape[1]])
  with jax.set_mesh(mesh), use_rules(rules):
    fn = jax.jit(lambda q, k, v, s: attend(q, k, v, s, options=FLASH))
    got = fn(q, k, v, seg)
  np.testing.assert_allclose(got, xla_attention(q, k, v, seg), atol=2e-5, rtol=0)


def test_flash_refuses_lengths_the_kernel_cannot_tile():
  q = jnp.zeros((1, 100, 2, 128))
  with pytest.raises(ValueError, match="multiples of 128"):
    attention_core(q, q, q, options=FLASH)
  assert not flash.supports(100, 100) and flash.supports(384, 384)
  assert flash._block(512, 384) == 384 and flash._block(256, 384) == 128


@pytest.mark.parametrize("field,value,match", [
    ("model.attention", "'splash'", "model.attention='splash'"),
    ("model.flash_block_q", "100", "multiple of 128"),
    ("model.attention_window", "0", "attention_window"),
])
def test_bad_attention_options_name_the_field(field, value, match):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [f"{field}={value}"])
  with pytest.raises(configs.ConfigError, match=match):
    configs.build(cfg)


# --- what the TPU compiler gets (libtpu topology, AOT from this CPU) ---------------------
SEQ = 384   # distinct from every model width, so an [.., S, S] buffer is recognisable
TINY_TPU = ["data.source='synthetic'", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
            f"data.seq_len={SEQ}", f"model.max_len={SEQ}", "train.global_batch=8", "sharding.preset='fsdp'",
            "model.d_model=256", "model.d_ff=512", "model.dtype='bfloat16'", "model.remat='full'",
            "mesh.topology='v5e:2x2'", "mesh.ici=(4,1)"]
SXS = re.compile(rf"\[[0-9,]*{SEQ},{SEQ}\]")


def compiled_hlo(*sets):
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, TINY_TPU + list(sets))
  mesh, setup = dry_run.prepare(configs.build(cfg))
  return dry_run.compile_step(setup).as_text()


def test_tpu_compile_runs_the_kernel_and_holds_no_score_matrix():
  auto = compiled_hlo("model.attention='auto'")
  assert "tpu_custom_call" in auto and not SXS.search(auto)
  xla = compiled_hlo("model.attention='xla'")        # the control: the einsum path holds S x S
  assert "tpu_custom_call" not in xla and SXS.search(xla)
