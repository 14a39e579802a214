"""The central property: every parallelism mode computes what one device computes.

For each mode the same LM (same weights, same batch) gives the single-device loss
and gradients, and its compiled step communicates what the mode should: DP an
all-reduce of the gradients, FSDP all-gathers of weights and reduce-scatters of
gradients, TP all-reduces of activations.
"""

import jax
import numpy as np
import pytest

from shardax import configs
from shardax.sharding import report, use_rules
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, setup_for
from shardax.trainer import step as step_lib

MODES = {
    "dp": ((8,), ("data",)),
    "fsdp": ((8,), ("data",)),
    "tp": ((1, 8), ("data", "model")),
    "2d": ((2, 4), ("data", "model")),
    "dp_fsdp_tp": ((2, 2, 2), ("data", "fsdp", "model")),
}


def experiment(preset, ici, axes):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=8", "model.d_ff=128",
      "model.max_len=16", "data.seq_len=16", "train.global_batch=8", "data.source='synthetic'",
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}"])
  return configs.build(cfg)


@pytest.fixture(scope="module")
def reference():
  """Params, a batch, and loss/grads on one device with no sharding at all."""
  exp = experiment("dp", (1,), ("data",))
  setup = setup_for(exp, jax.devices()[:1])
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  return jax.device_get(params), batch, float(loss), jax.device_get(grads)


@pytest.fixture(scope="module", params=list(MODES))
def sharded(request, reference):
  preset = request.param
  ici, axes = MODES[preset]
  setup = setup_for(experiment(preset, ici, axes))
  params_host, batch, _, _ = reference
  params = jax.device_put(params_host, setup.shardings["params"])
  batch = jax.device_put(batch, setup.batch_sharding)
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  return preset, setup, float(loss), jax.device_get(grads), compiled


def test_loss_and_grads_equal_single_device(sharded, reference):
  preset, _, loss, grads, _ = sharded
  _, _, ref_loss, ref_grads = reference
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat) > 10
  for g, r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=preset)


def param_bytes(setup):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract["params"]))


def test_compiled_collectives_match_the_mode(sharded):
  preset, setup, _, _, compiled = sharded
  summary = report.collective_summary(compiled.as_text())
  total = param_bytes(setup)
  if preset == "dp":
    # All-reduces of the gradients only (scanned layers: one per layer). The tied
    # embedding gets two gradient parts (lookup and output head), reduced before they
    # are added, hence up to ~20% more than the parameter bytes at this tiny size.
    assert set(summary) == {"all-reduce"}
    assert 0.95 * total <= summary["all-reduce"]["bytes"] <= 1.25 * total
  if preset == "fsdp":
    # Weights are gathered before use (forward and again in backward) ...
    assert summary["all-gather"]["bytes"] >= 0.9 * total
    # ... and gradients reduced to their shards: a reduce-scatter on TPU/GPU; the CPU
    # backend writes it as an all-reduce followed by a slice.
    reduced = sum(summary.get(k, {}).get("bytes", 0) for k in ("reduce-scatter", "all-reduce"))
    assert reduced >= 0.9 * total
  if preset == "tp":
    # Megatron: activations are summed across the model axis in forward and backward;
    # weights never move.
    acts = [c for c in report.collectives(compiled.as_text()) if c.kind == "all-reduce" and c.group_size == 8]
    assert len(acts) >= 4
    assert "all-gather" not in summary or summary["all-gather"]["bytes"] < 0.2 * total


def shard_bytes(tree) -> int:
  """Bytes one device holds of an abstract tree whose leaves carry their shardings."""
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_fsdp_reduce_scatters_gradients_where_dp_all_reduces_them(sharded):
  """What tells FSDP from DP (the CPU backend writes both reductions as all-reduces): the
  compiled step hands each device the reduced gradient of its 1/8 shard only (and the
  values equal the single-device gradient: test above), and each device keeps 1/8 of the
  Adam moments; DP hands every device the whole reduced gradient and all the moments."""
  preset, setup, _, _, compiled = sharded
  if preset not in ("dp", "fsdp"):
    pytest.skip("DP vs FSDP only")
  total = param_bytes(setup)
  grads_out = report.memory(compiled)["output_bytes"]  # the gradients, plus a few scalars
  moments = 2 * total  # AdamW's mu and nu, float32 like the params
  share = {"dp": 1, "fsdp": 8}[preset]
  assert abs(grads_out - total / share) <= 0.01 * total / share, (preset, grads_out, total)
  assert abs(shard_bytes(setup.abstract["opt_state"]) - moments / share) <= 0.01 * moments / share


@pytest.mark.parametrize("preset", ["fsdp", "2d"])
def test_sharded_params_take_a_device_share(preset):
  ici, axes = MODES[preset]
  setup = setup_for(experiment(preset, ici, axes))
  fn = jax.jit(lambda p, b: step_lib.grads_and_loss(setup, p, b)[0],
               in_shardings=(setup.shardings["params"], setup.batch_sharding))
  batch = step_lib.abstract_batch(setup)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    compiled = fn.lower(setup.abstract["params"], batch).compile()
  args = report.memory(compiled)["argument_bytes"] - 2 * 8 * 16 * 4 // 8
  expected = param_bytes(setup) / 8
  assert abs(args - expected) <= 0.1 * expected, (args, expected)
