"""Context parallelism (layers/context_parallel.py) computes what one device computes.

The same tiny GQA LM (8 query heads, 4 kv heads of dim 8), the same packed batch (3 documents
per window, positions restarting per document, padding with loss mask 0 at the end of
one row), on meshes where the rules split `length`: all-gather and ring modes, on
(data 2 x context 4), composed with FSDP over both axes and with Megatron tensor
parallelism, and on (8,) all context. Loss and gradients must equal the single-device
run (float32: loss rtol 1e-5, gradients rtol 2e-4 / atol 2e-6, as test_parallelism),
and the compiled step must hold the collectives context parallelism adds.
"""

import jax
import numpy as np
import pytest

from shardax import configs
from shardax.configs.schema import ConfigError
from shardax.layers import context_parallel as cp
from shardax.sharding import report
from shardax.trainer import state as state_lib
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
  """Three documents per window (lengths vary by row), the last row ends in padding."""
  tokens = rng.integers(1, 256, size=(BATCH, SEQ + 1)).astype(np.int32)
  seg = np.zeros((BATCH, SEQ), np.int32)
  pos = np.zeros((BATCH, SEQ), np.int32)
  for r in range(BATCH):
    cuts = sorted(rng.choice(np.arange(3, SEQ - 3), size=2, replace=False))
    bounds = [0, *cuts, SEQ - (5 if r == BATCH - 1 else 0)]
    for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[r, a:b] = d + 1
      pos[r, a:b] = np.arange(b - a)
  mask = (seg > 0).astype(np.float32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
          "positions": pos, "loss_mask": mask}


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
