"""Delayed fp8 scaling (model.quantization='fp8_delayed'): the amax history steers the
dot, and one step writes each history once, from the max over every use of its weight
(pipeline iterations and circular repeats, gradient-accumulation microbatches).

The reference is the unpipelined 4-layer LM in one batch on one device: its next
histories are the oracle (the weight row is also checked against max |W| itself). Every
run starts from the same non-empty histories, so all of them quantize with the same
delayed scales and see the same activations; with empty ones each pipeline microbatch
would scale by its own amax and the activations would differ by fp8 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import pipeline
from shardax.layers import quantization
from shardax.sharding import use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from meshtools import loss_and_grads, setup_for, tiny_lm

L, BATCH, H = 4, 8, 16  # H: DenseGeneral's default quantization_history


def experiment(stages=1, micro=1, repeats=1, accumulate=1, quant="fp8_delayed", dtype="float32",
               ici=(1, 1), axes=("data", "model"), preset="dp", extra=()):
  return tiny_lm(L, BATCH, stages, micro, repeats, ici, axes, preset,
                 extra=[f"model.quantization={quant!r}", f"model.dtype={dtype!r}",
                        f"train.microbatches={accumulate}", *extra])


def histories(tree) -> dict:
  """{path: array} of every amax history (or its next value) in a params/grads tree."""
  found = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): np.asarray(a) for p, a in found if quantization.is_history(p)}


def seeded(params: dict) -> dict:
  """params with every history set to newest [3.0, 0.5] (activation, weight), older [2.0, 0.25]:
  large enough that the runs quantize alike, and an older entry that must move back one."""
  past = np.zeros((2, H), np.float32)
  past[:, 0], past[:, 1] = (3.0, 0.5), (2.0, 0.25)
  return jax.tree_util.tree_map_with_path(
      lambda p, a: np.broadcast_to(past, a.shape).copy() if quantization.is_history(p) else a, params)


@pytest.fixture(scope="module")
def reference():
  """Unpipelined, one batch, one device: (params, batch, next histories, kernels)."""
  setup = setup_for(experiment(), jax.devices()[:1])
  params = seeded(jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"]))
  tokens = np.random.default_rng(0).integers(1, 256, size=(BATCH, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (_, grads, _), _ = loss_and_grads(setup, params, batch)
  return params, batch, histories(jax.device_get(grads))


def test_reference_history_is_the_step_amax_pushed_in_front(reference):
  params, _, nexts = reference
  kernels = {jax.tree_util.keystr(p[:-1]): np.asarray(a) for p, a in
             jax.tree_util.tree_flatten_with_path(params)[0] if getattr(p[-1], "key", None) == "kernel"}
  assert len(nexts) == 7  # q, k, v, out, gate, up, down; each [L, 2, H]
  for path, nxt in nexts.items():
    w = kernels[path.replace("['amax_history']", "")]
    np.testing.assert_array_equal(nxt[:, 1, 0], np.abs(w).reshape(L, -1).max(axis=1), err_msg=path)
    assert np.all(nxt[:, 0, 0] > 0), path
    np.testing.assert_array_equal(nxt[:, :, 1], np.broadcast_to([3.0, 0.5], (L, 2)), err_msg=path)
    np.testing.assert_array_equal(nxt[:, :, 2], np.broadcast_to([2.0, 0.25], (L, 2)), err_msg=path)


# name: (stages, microbatches, repeats, train.microbatches, mesh ici, mesh axes, preset)
CASES = {
    "pipeline_S2_M4": (2, 4, 1, 1, (1, 1), ("data", "model"), "dp"),
    "circular_S2_M4_R2_stage2xdata2": (2, 4, 2, 1, (2, 2), ("stage", "data"), "pp_dp"),
    "accumulate_2": (1, 1, 1, 2, (1, 1), ("data", "model"), "dp"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_history_entry_is_the_max_over_every_use_of_the_weight(name, reference):
  """Pipelined (each stage's weights run in all M*R + S - 1 iterations, bubble included)
  or accumulated over 2 microbatches: the next history equals the unpipelined one-batch
  run's, whose newest entry is the max over the batch (before: the uses' sum or mean)."""
  stages, micro, repeats, accumulate, ici, axes, preset = CASES[name]
  ref_params, batch, ref_next = reference
  setup = setup_for(experiment(stages, micro, repeats, accumulate, ici=ici, axes=axes, preset=preset),
                    jax.devices()[:int(np.prod(ici))])
  params = dict(ref_params)
  if stages > 1:
    params["layers"] = pipeline.stage_params(ref_params["layers"], stages, repeats)
  (_, grads, _), _ = loss_and_grads(setup, params, batch)
  grads = jax.device_get(grads)
  if stages > 1:
    grads["layers"] = pipeline.unstage_params(grads["layers"], repeats)
  got = histories(grads)
  assert got.keys() == ref_next.keys()
  for path, want in ref_next.items():
    # Same delayed scales, same activations: equal up to f32 summation order.
    np.testing.assert_allclose(got[path], want, rtol=1e-5, err_msg=f"{name} {path}")


def test_history_sets_the_scale_of_the_quantized_dot():
  """A small remembered amax saturates that operand at it (as Transformer Engine does),
  so the dot becomes the dot of the clipped operand; an empty history scales by the
  tensor's own amax and stays near the exact dot."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)          # max |x| 2.3
  w = jnp.asarray(rng.normal(size=(16, 8)) * 0.3, jnp.float32)    # max |w| 0.93
  dn = (((1,), (0,)), ((), ()))
  exact = x @ w
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

  def dot(x_amax, w_amax):
    history = quantization.history_init(H).at[0, 1].set(x_amax).at[1, 2].set(w_amax)
    return quantization.dot_general("fp8_delayed", x, w, dn, history=history)

  assert rel(dot(0.0, 0.0), exact) < 0.06
  clipped_x, clipped_w = dot(0.5, 0.0), dot(0.0, 0.1)
  assert rel(clipped_x, exact) > 0.4 and rel(clipped_x, jnp.clip(x, -0.5, 0.5) @ w) < 0.06
  assert rel(clipped_w, exact) > 0.4 and rel(clipped_w, x @ jnp.clip(w, -0.1, 0.1)) < 0.06


def losses(quant: str, steps: int = 12) -> list[float]:
  """Train losses of a pipelined 4-layer bf16 LM (2 stages x 4 microbatches, one device)
  over 4 fixed batches in turn."""
  exp = experiment(2, 4, quant=quant, dtype="bfloat16", extra=(
      "model.d_model=64", "model.d_ff=128", "model.max_len=32", "data.seq_len=32",
      "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=2", f"train.steps={steps}"))
  setup = setup_for(exp, jax.devices()[:1])
  tokens = np.random.default_rng(0).integers(1, 256, size=(4, BATCH, 33)).astype(np.int32)
  out = []
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    state, step = state_lib.init_fn(setup)(jax.random.key(0)), step_lib.train_step_fn(setup)
    for i in range(steps):
      state, metrics = step(state, {"inputs": tokens[i % 4, :, :-1], "targets": tokens[i % 4, :, 1:]})
      out.append(float(metrics["loss"]))
  return out


@pytest.mark.slow   # two compiles and 24 steps: ~40 s idle, ~90 s on 2 busy cores
def test_pipelined_fp8_delayed_trains_like_bf16():
  """Measured (2026-11-26): bf16 6.26 -> 3.47 over steps 9-12; fp8_delayed within 1% of it.
  Before, the histories grew 5x a step (each stage's uses summed) until the scaled operands
  underflowed fp8: from step 8 the loss climbed back to 7.1."""
  bf16, fp8 = losses("none"), losses("fp8_delayed")
  assert np.mean(bf16[-4:]) < bf16[0] - 2.0, bf16       # the control learns the 4 batches
  np.testing.assert_allclose(np.mean(fp8[-4:]), np.mean(bf16[-4:]), rtol=0.03, err_msg=f"{fp8} vs {bf16}")
