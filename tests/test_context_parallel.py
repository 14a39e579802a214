"""Context parallelism (layers/context_parallel.py) computes what one device computes.

The same tiny GQA LM (8 query heads, 4 kv heads of dim 8), the same packed batch (3 documents
per window, positions restarting per document, padding with loss mask 0 at the end of
one row), on meshes where the rules split `length`: all-gather and ring modes, on
(data 2 x context 4), composed with FSDP over both axes and with Megatron tensor
parallelism, and on (8,) all context. Loss and gradients must equal the single-device
run (float32: loss rtol 1e-5, gradients rtol 2e-4 / atol 2e-6, as test_parallelism),
and the compiled step must hold the collectives context parallelism adds.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.configs.schema import ConfigError
from shardax.layers import context_parallel as cp
from shardax.layers.attention import AttentionOptions, xla_attention
from shardax.sharding import report, use_rules
from shardax.trainer import state as state_lib
import meshtools
from meshtools import coordinates, loss_and_grads, pairs, setup_for

SEQ, BATCH = 32, 4
# name -> (mesh.ici, mesh.axes, sharding preset or explicit rules, model.context_parallel)
CASES = {
    "allgather_dp2_cp4": ((2, 4), ("data", "context"), "dp_cp", "allgather"),
    "ring_dp2_cp4": ((2, 4), ("data", "context"), "dp_cp", "ring"),
    "ring_fsdp_cp4": ((2, 4), ("data", "context"), "fsdp_cp", "ring"),
    "allgather_tp4_cp2": ((1, 2, 4), ("data", "context", "model"), "tp_cp", "allgather"),
    "allgather_cp8": ((8,), ("context",), (("length", "context"),), "allgather"),
    "ring_cp8": ((8,), ("context",), (("length", "context"),), "ring"),
}


def experiment(ici, axes, sharding, mode, seq=SEQ):
  cfg = configs.get("lm.tiny")
  rules = (f"sharding.preset={sharding!r}" if isinstance(sharding, str)
           else f"sharding.rules={sharding!r}")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=8", "model.num_kv_heads=4",
      "model.d_ff=128", f"model.max_len={seq}", f"data.seq_len={seq}",
      f"train.global_batch={BATCH}", "data.source='stdlib'", rules,
      f"model.context_parallel={mode!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}"])
  return configs.build(cfg)


def packed_batch(rng) -> dict:
  return meshtools.packed_batch(rng, BATCH, SEQ)


@pytest.fixture(scope="module")
def reference():
  """Params, the packed batch, and loss/grads on one device with no sharding."""
  setup = setup_for(experiment((1,), ("data",), "dp", "allgather"), jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  batch = packed_batch(np.random.default_rng(0))
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  return params, batch, float(loss), jax.device_get(grads)


@pytest.fixture(scope="module", params=list(CASES))
def sharded(request, reference):
  ici, axes, sharding, mode = CASES[request.param]
  setup = setup_for(experiment(ici, axes, sharding, mode))
  params, batch, _, _ = reference
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  return request.param, setup, float(loss), jax.device_get(grads), compiled


def test_loss_and_grads_equal_single_device(sharded, reference):
  name, setup, loss, grads, _ = sharded
  _, _, ref_loss, ref_grads = reference
  assert setup.batch_sharding["inputs"].spec[1] is not None, "length must be split"
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=name)
  flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat) > 5
  for g, r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=name)


def context_coordinates(setup):
  mesh_shape = dict(setup.mesh.shape)
  coords = coordinates(mesh_shape)
  others = [coords[a] for a in mesh_shape if a != "context"]
  return coords["context"], (np.stack(others, 1) if others else np.zeros((len(coords["context"]), 0)))


def test_compiled_step_holds_the_collectives_context_parallelism_adds(sharded):
  """The collectives inside the attention's shard_map. 'allgather': all-gathers over
  the context groups whose result is whole sequences of K or V of the device's rows and
  heads (reduce-scatters of dK, dV in the backward); 'ring': collective-permutes of K/V blocks to the context neighbour (context
  coordinate +-1 mod C, all other coordinates equal), C - 1 per direction at least."""
  name, setup, _, _, compiled = sharded
  ops = [o for o in report.collectives(compiled.as_text()) if "shard_map" in o.op_name]
  c = setup.mesh.shape["context"]
  ctx, rest = context_coordinates(setup)
  rows = BATCH // setup.mesh.shape.get("data", 1)
  kv_local = 4 // setup.mesh.shape.get("model", 1)    # kv heads per device (tensor parallel)
  block = rows * (SEQ // c) * kv_local * 8 * 4        # a device's K (or V) block, f32 bytes
  seen = [(o.kind, o.bytes, o.group_size, o.replica_groups[:50]) for o in ops]
  if name.startswith("allgather"):
    gathers = [o for o in ops if o.kind == "all-gather" and o.group_size == c and o.bytes == c * block]
    assert len(gathers) >= 2, seen                      # K and V, at least
    # ... and their transposes in the backward pass: dK, dV reduce-scattered to the blocks.
    assert sum(o.kind == "reduce-scatter" and o.bytes == c * block for o in ops) >= 2, seen
    assert not any(o.kind == "collective-permute" for o in ops), seen
  else:
    ring = []
    for o in ops:
      ps = pairs(o, setup.mesh.size) if o.kind == "collective-permute" else []
      if o.bytes >= block and ps and all(
          (ctx[t] - ctx[s]) % c in (1, c - 1) and (rest[s] == rest[t]).all() for s, t in ps):
        ring.append(o)
    assert len(ring) >= 2 * (c - 1), seen               # forward and backward
    assert not any(o.kind == "all-gather" for o in ops), seen


def test_sequence_not_divisible_by_two_chunks_per_device_is_a_clear_error(reference):
  setup = setup_for(experiment((8,), ("context",), (("length", "context"),), "ring", seq=24))
  params, _, _, _ = reference
  batch = {k: v[:, :24] for k, v in packed_batch(np.random.default_rng(1)).items()}
  with pytest.raises(cp.ContextParallelError, match=r"data.seq_len to a multiple of 16"):
    loss_and_grads(setup, params, batch)


def test_unknown_mode_names_the_field():
  with pytest.raises(ConfigError, match=r"model.context_parallel='rings'"):
    experiment((8,), ("context",), (("length", "context"),), "rings")


def test_balanced_order_gives_every_device_the_same_causal_work():
  """Chunks i and 2C-1-i on device i: equal visible (query, key) pairs per device, and
  `unbalance` inverts `balance`."""
  s, c = 64, 4
  order = cp.balanced_order(s, c).reshape(c, -1)
  work = [sum(int(p) + 1 for p in row) for row in order]
  assert len(set(work)) == 1
  natural = [sum(p + 1 for p in range(i * s // c, (i + 1) * s // c)) for i in range(c)]
  assert len(set(natural)) == c        # the natural order is unbalanced
  x = np.arange(2 * s).reshape(2, s)
  np.testing.assert_array_equal(cp.unbalance(cp.balance(x, c), c), x)


# --- options and the flash kernel on the context-parallel path ------------------------------
def test_window_and_softcap_reach_the_context_parallel_path(reference):
  """The model's attention_window / attention_softcap on a split sequence: loss and grads
  equal one device's with the same options (and differ from those without: not dropped)."""
  def built(ici, axes, preset):
    cfg = configs.get("lm.tiny")
    configs.apply_overrides(cfg, [
        "model.num_layers=2", "model.d_model=64", "model.num_heads=8", "model.num_kv_heads=4",
        "model.d_ff=128", f"model.max_len={SEQ}", f"data.seq_len={SEQ}", f"train.global_batch={BATCH}",
        "data.source='stdlib'", f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}",
        "model.attention_window=5", "model.attention_softcap=2.0"])
    return configs.build(cfg)
  params, batch, plain_loss, _ = reference
  (want, want_grads, _), _ = loss_and_grads(setup_for(built((1,), ("data",), "dp"), jax.devices()[:1]),
                                            params, batch)
  assert abs(float(want) - plain_loss) > 1e-4                # the options change the loss
  (loss, grads, _), _ = loss_and_grads(setup_for(built((2, 4), ("data", "context"), "dp_cp")), params, batch)
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


def _vs_one_device(options, mode, balanced, shape, mesh_shape=(2, 2)):
  """Context-parallel attention (data x context mesh) and the single-device einsum attention
  on random q/k/v[shape] with 3 packed documents per row: (max |out error|, per q/k/v the
  max gradient error relative to that gradient's largest entry)."""
  b, l, n, kv, d = shape
  ks = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(ks[0], (b, l, n, d))
  k, v = (jax.random.normal(key, (b, l, kv, d)) for key in ks[1:3])
  cot = jax.random.normal(ks[3], q.shape)
  cuts = np.array([0, l * 2 // 5, l * 3 // 4, l])
  row = np.repeat(np.arange(1, 4), np.diff(cuts))
  seg = jnp.asarray(np.stack([np.roll(row, 7 * r) for r in range(b)]), jnp.int32)
  c = mesh_shape[1]
  mesh = jax.make_mesh(mesh_shape, ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:math.prod(mesh_shape)])
  order = (lambda x: cp.balance(x, c)) if balanced else (lambda x: x)
  back = (lambda x: cp.unbalance(x, c)) if balanced else (lambda x: x)

  def sharded(q, k, v):
    with cp.sequence(mode, balanced):
      return back(cp.attention(order(q), order(k), order(v), order(seg), options=options))

  def one(q, k, v):
    return xla_attention(q, k, v, seg, window=options.window, softcap=options.softcap)

  def out_and_grads(f):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cot)

  with jax.set_mesh(mesh), use_rules((("batch", "data"), ("length", "context"))):
    out, grads = jax.jit(lambda: out_and_grads(sharded))()
  want, want_grads = out_and_grads(one)
  return (float(jnp.max(jnp.abs(out - want))),
          [float(jnp.max(jnp.abs(g - e)) / jnp.max(jnp.abs(e))) for g, e in zip(grads, want_grads)])


@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_einsum_blocks_apply_window_and_softcap(mode):
  """A window of 5 (crossing chunk and device boundaries of 4-token chunks) and a soft-cap,
  both modes, balanced order, on data 2 x context 4."""
  opts = AttentionOptions("xla", window=5, softcap=2.0)
  err, grad_errs = _vs_one_device(opts, mode, True, (2, 32, 4, 2, 8), mesh_shape=(2, 4))
  assert err <= 1e-5 and max(grad_errs) <= 1e-5, (err, grad_errs)


# The splash kernel in Pallas interpret mode (as tests/test_flash.py): 2 rows of 256 tokens,
# 3 packed documents each (boundaries inside kernel blocks), GQA 2 q / 1 kv heads of 128, on
# data 2 x context 2, against the single-device einsum attention on the natural order. The
# kernel must run (the lowered program holds the splash scope), not the einsum blocks.
FLASH_SHAPE = (2, 256, 2, 1, 128)


def _flash(**kw):
  return AttentionOptions("flash", flash_block_q=128, flash_block_kv=128, interpret=True, **kw)


def test_flash_kernel_under_context_parallelism_equals_one_device_balanced_packed():
  """All-gather CP running the splash kernel on each device's rows (chunks i and 2C-1-i):
  float32, outputs within 2e-5 and gradients within 1e-4 of the largest entry, the
  tolerances of tests/test_flash.py (the kernel's online softmax sums in another order)."""
  err, grad_errs = _vs_one_device(_flash(), "allgather", True, FLASH_SHAPE)
  assert err <= 2e-5, err
  assert max(grad_errs) <= 1e-4, grad_errs


def test_flash_kernel_under_context_parallelism_with_window_and_softcap():
  """The contiguous layout, a sliding window crossing the device boundary and a soft-cap."""
  err, grad_errs = _vs_one_device(_flash(window=48, softcap=5.0), "allgather", False, FLASH_SHAPE)
  assert err <= 2e-5, err
  assert max(grad_errs) <= 1e-4, grad_errs


def test_context_parallel_attention_resolves_to_the_kernel():
  """'flash' (and 'auto' on a TPU) take the kernel path: its scope is in the lowered program."""
  q = jnp.zeros((2, 256, 2, 128))
  mesh = jax.make_mesh((2, 2), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:4])
  with jax.set_mesh(mesh), use_rules((("batch", "data"), ("length", "context"))), cp.sequence("allgather", True):
    lowered = lambda opts: jax.jit(lambda q: cp.attention(q, q[:, :, :1], q[:, :, :1], options=opts)).lower(q).as_text()
    assert "splash" in lowered(_flash()) and "splash" not in lowered(AttentionOptions("xla"))


def test_ring_refuses_an_explicit_flash_kernel():
  q = jnp.zeros((2, 256, 4, 128))
  mesh = jax.make_mesh((2, 2), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:4])
  with jax.set_mesh(mesh), use_rules((("batch", "data"), ("length", "context"))), cp.sequence("ring", True):
    with pytest.raises(cp.ContextParallelError, match="context_parallel='allgather'"):
      cp.attention(q, q[:, :, :2], q[:, :, :2], options=AttentionOptions("flash", interpret=True))
