"""MoE models in the pipeline: each stage runs its MoE units (all-to-alls inside its stage
group), and the routing statistics (balance and z losses, load metrics, the next balance
bias) come out of the loop per layer, from the real work items only.

The reference is the same model unpipelined on one device with the batch in M accumulation
microbatches (train.microbatches = M), which splits the rows as the pipeline does (row
i*M + j in microbatch j): the balance statistics are per microbatch in both, so losses,
metrics, bias updates and gradients must agree.
"""

import jax
import numpy as np
import pytest

from shardax import configs, pipeline
from shardax.configs.schema import ConfigError
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, setup_for

BATCH, M = 16, 4


def experiment(name, layers, stages=1, repeats=1, ici=(1, 1), axes=("data", "model"), preset="dp",
               accum=1, extra=()):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, [
      f"model.num_layers={layers}", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
      "model.moe.d_ff=32", "model.max_len=16", "data.seq_len=16", f"train.global_batch={BATCH}",
      "data.source='synthetic'", f"model.pipeline.stages={stages}",
      f"model.pipeline.microbatches={M if stages > 1 else 1}",
      f"model.pipeline.circular_repeats={repeats}", f"train.microbatches={accum}",
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}", *extra])
  return configs.build(cfg)


def scalars(metrics):
  return {k: float(v) for k, v in metrics.items()
          if not isinstance(v, dict) and np.ndim(v) == 0 and k != "loss_weight"}


# name: (experiment, layers, stages, repeats, mesh ici, mesh axes, preset)
CASES = {
    "mixtral_S2_R1_expert_parallel": ("moe.mixtral_tiny", 4, 2, 1, (2, 4), ("stage", "data"), "pp_expert"),
    "mixtral_S2_R2_data_parallel": ("moe.mixtral_tiny", 4, 2, 2, (2, 4), ("stage", "data"), "pp_dp"),
    # a first dense layer before the pipeline, bias balancing, a shared expert, sigmoid top-7
    "deepseek_S2_R2_expert_axis": ("moe.deepseek_tiny", 5, 2, 2, (2, 2, 2), ("stage", "data", "expert"),
                                   "pp_expert_axis"),
}
# The default suite runs the DeepSeek case (the most options at once); -m slow the others
# (~10 s each; tests/test_combinations.py also runs a dropless MoE through 2 stages).
SLOW = {"mixtral_S2_R1_expert_parallel", "mixtral_S2_R2_data_parallel"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES])
def test_pipelined_moe_equals_accumulation_microbatches_on_one_device(case):
  name, layers, stages, repeats, ici, axes, preset = CASES[case]
  ref = setup_for(experiment(name, layers, accum=M), jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(ref)(jax.random.key(0))["params"])
  tokens = np.random.default_rng(0).integers(1, 256, size=(BATCH, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, metrics), _ = loss_and_grads(ref, params, batch)

  setup = setup_for(experiment(name, layers, stages, repeats, ici, axes, preset))
  staged = dict(params, layers=dict(params["layers"], blocks=pipeline.stage_params(
      params["layers"]["blocks"], stages, repeats)))
  (p_loss, p_grads, p_metrics), _ = loss_and_grads(setup, staged, batch)
  p_grads = jax.device_get(p_grads)
  p_grads["layers"]["blocks"] = pipeline.unstage_params(p_grads["layers"]["blocks"], repeats)

  np.testing.assert_allclose(p_loss, loss, rtol=1e-5, err_msg=case)
  want = scalars(metrics)
  assert any(k.startswith("moe/") for k in want)
  for k, v in want.items():
    np.testing.assert_allclose(scalars(p_metrics)[k], v, rtol=1e-5, atol=1e-7, err_msg=f"{case}: {k}")
  for k in ("moe/routed_copies_count", "moe/dropped_copies_count"):   # per layer, the whole batch's
    np.testing.assert_array_equal(p_metrics[k], metrics[k], err_msg=f"{case}: {k}")
  model = ref.exp.model
  assert metrics["moe/routed_copies_count"].tolist() == [BATCH * 16 * model.moe.top_k] * model.num_moe_layers
  updates, p_updates = metrics.get("state_updates"), p_metrics.get("state_updates")
  assert (updates is None) == (p_updates is None)
  if p_updates is not None:  # written in the params' stage layout
    p_updates = jax.device_get(p_updates)
    p_updates["layers"]["blocks"] = pipeline.unstage_params(p_updates["layers"]["blocks"], repeats)
  for a, b in zip(jax.tree.leaves(p_updates or {}), jax.tree.leaves(updates or {})):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"{case}: next balance bias")
  flat, ref_flat = jax.tree.leaves(p_grads), jax.tree.leaves(grads)
  assert len(flat) == len(ref_flat) > 8
  for g, r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=case)


def test_layer_stats_pick_each_layers_real_work_items():
  """Unit l of microbatch m at iteration t = r*M + m + h*s on stage s: a per-iteration
  record of (t, s, unit) must come back as each layer's mean over its microbatches."""
  for S, Mb, R, u, delay in [(2, 4, 1, 2, False), (4, 4, 2, 1, False), (2, 4, 2, 3, True)]:
    sched = pipeline.Schedule(S, Mb, R, delay)
    T = sched.iterations
    t, s, unit = np.meshgrid(np.arange(T), np.arange(S), np.arange(u), indexing="ij")
    record = {"t": t.astype(np.float32), "s": s, "unit": unit}
    got = pipeline.layer_stats(record, sched, u)
    layers = np.arange(S * R * u)
    stage, rep = (layers // u) % S, layers // (S * u)
    np.testing.assert_array_equal(got["s"], stage)
    np.testing.assert_array_equal(got["unit"], layers % u)
    first = rep * Mb + sched.hop * stage        # microbatch 0's iteration; the mean adds (M-1)/2
    np.testing.assert_allclose(got["t"], first + (Mb - 1) / 2)


def test_random_second_expert_is_refused_in_a_pipeline():
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, ["model.pipeline.stages=2", "model.pipeline.microbatches=2",
                                "model.moe.dispatch='capacity'", "model.moe.second_expert='random'"])
  with pytest.raises(ConfigError, match="second_expert='all' or dispatch='dropless'"):
    configs.build(cfg)


def test_the_train_step_writes_the_pipelined_balance_bias_in_the_stage_layout():
  """The real train step (trainer/step.py) of a bias-balanced MoE through 2 stages x 2 repeats:
  the next balance bias comes out of the loop per layer ([L, e]) and is written over the
  params, which a pipelined stack keeps in the stage layout ([S, R, L/(S*R), e]). Written
  as it came, the step failed to trace (cond branches of different types); it must
  leave the same bias, unstaged, as the unpipelined step with M accumulation microbatches."""
  from shardax.trainer import step as step_lib
  name, layers, stages, repeats, ici, axes, preset = CASES["deepseek_S2_R2_expert_axis"]
  tokens = np.random.default_rng(0).integers(1, 256, size=(BATCH, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  biases = []
  for setup in (setup_for(experiment(name, layers, accum=M), jax.devices()[:1]),
                setup_for(experiment(name, layers, stages, repeats, ici, axes, preset))):
    state = state_lib.init_fn(setup)(jax.random.key(0))
    if setup.exp.model.pipeline.stages == 1:
      state["params"] = jax.device_get(state["params"])
    new, _ = step_lib.train_step_fn(setup)(state, batch)
    bias = jax.device_get(new["params"]["layers"]["blocks"]["moe_block"]["moe"]["balance_bias"])
    biases.append(bias if setup.exp.model.pipeline.stages == 1 else pipeline.from_stages(bias, repeats))
  assert np.abs(biases[0]).max() > 0
  np.testing.assert_allclose(biases[1], biases[0], rtol=1e-6, atol=1e-7)
