"""The combination matrix: model x layout x 8-bit mode, on packed documents.

Each cell either computes what one device computes (loss and every gradient, amax histories'
next values included) or is refused at config time with an error naming the combination.
Models: the dense LM and the same LM with MoE layers (dropless top-2 of 4 experts every 2nd
layer). Layouts on 8 simulated devices: fsdp (8,), 2d (2 data x 4 model), dp_cp with
all-gather and with ring attention (2 data x 4 context), 2 pipeline stages (2 stage x 4
data, 2 microbatches), expert parallelism (2 data x 4 expert; MoE only). Modes: no
quantization, int8, fp8 with delayed scaling. Compute in float32, so the tolerances are those
of the existing equality tests: test_parallelism's for unquantized cells (loss rtol 1e-5,
gradients rtol 2e-4 / atol 2e-6), test_quantization's for 8-bit ones (loss rtol 5e-4,
gradients within 5% of their norm: a sharded program's other summation order moves values
across 8-bit rounding boundaries). MoE 8-bit cells allow 15%: such a flip can also move a
token whose top experts nearly tie to another expert (seen: int8 on (data 2, context 4) gives
a max expert load one token copy off the one-device run's, and every gradient upstream of
the MoE layer moves 4-8%; unquantized MoE cells are exact to the tight tolerances). fp8
histories start seen (`with_seen_histories`): the amax history's next values must then match.

The default suite runs a diagonal that reaches every model, layout and mode at least once
(`DIAGONAL`); `-m slow` runs every cell. docs/combinations.md is the table of the full run.
"""

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from shardax import configs, pipeline
from shardax.configs.schema import ConfigError
from shardax.layers import quantization
from shardax.sharding import report
from shardax.trainer import state as state_lib
import meshtools
from meshtools import loss_and_grads, setup_for

SEQ, BATCH = 32, 8
MODELS = {
    "dense": [],
    "moe": ["model.moe.num_experts=4", "model.moe.d_ff=32", "model.moe.every=2", "model.moe.top_k=2",
            "model.moe.dispatch='dropless'"],
    # GShard's capacity dispatch (random second expert, tokens past capacity dropped): under
    # context parallelism it keeps the natural token order (layers/transformer.py).
    "moe_capacity": ["model.moe.num_experts=4", "model.moe.d_ff=32", "model.moe.every=2",
                     "model.moe.capacity_factor=1.0", "model.moe.second_expert='random'"],
}
# name -> (mesh.ici, mesh.axes, preset, extra overrides)
LAYOUTS = {
    "fsdp": ((8,), ("data",), "fsdp", []),
    "2d": ((2, 4), ("data", "model"), "2d", []),
    "dp_cp_allgather": ((2, 4), ("data", "context"), "dp_cp", ["model.context_parallel='allgather'"]),
    "dp_cp_ring": ((2, 4), ("data", "context"), "dp_cp", ["model.context_parallel='ring'"]),
    "pipeline_2": ((2, 4), ("stage", "data"), "pp_dp",
                   ["model.pipeline.stages=2", "model.pipeline.microbatches=2"]),
    "expert": ((2, 4), ("data", "expert"), "expert_axis", []),
}
QUANT = ("none", "int8", "fp8_delayed")
CELLS = [(m, lay, q) for m in MODELS for lay in LAYOUTS for q in QUANT
         if not (m == "dense" and lay == "expert") and not (m == "moe_capacity" and q != "none")]
DIAGONAL = [("dense", "fsdp", "int8"), ("moe", "2d", "none"), ("dense", "dp_cp_ring", "fp8_delayed"),
            ("moe", "dp_cp_allgather", "int8"), ("moe", "dp_cp_ring", "none"),
            ("dense", "pipeline_2", "fp8_delayed"), ("moe", "expert", "fp8_delayed"),
            ("moe", "pipeline_2", "none"), ("moe_capacity", "dp_cp_ring", "none")]
# Cells refused at config time: the words their error must hold.
# A pipeline stage draws no gating keys: GShard's random second expert is refused there.
REFUSED = {("moe_capacity", "pipeline_2"): "second_expert='all' or dispatch='dropless'"}


def experiment(model, quant, ici=(1,), axes=("data",), preset="dp", extra=()):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=4",
      "model.d_ff=128", f"model.max_len={SEQ}", f"data.seq_len={SEQ}", f"train.global_batch={BATCH}",
      "data.source='stdlib'", f"model.quantization={quant!r}", *MODELS[model],
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}", *extra])
  return configs.build(cfg)


def packed_batch(rng) -> dict:
  return meshtools.packed_batch(rng, BATCH, SEQ)


_REFERENCES = {}


def with_seen_histories(params: dict) -> dict:
  """fp8_delayed: every amax history as if steps had run (entries 4.0). An empty history
  scales each call by its own amax, and a pipeline or microbatch call sees part of the batch,
  so a first step legitimately differs from one device; from a seen history it must not."""
  return {k: with_seen_histories(v) if isinstance(v, dict) else
          (np.full_like(v, 4.0) if k == quantization.HISTORY else v) for k, v in params.items()}


def reference(model, quant, extra=()):
  """(params, batch, loss, grads) of one device, cached per (model, quant, extra) across
  cells; extra: model overrides."""
  key = (model, quant, tuple(extra))
  if key not in _REFERENCES:
    setup = setup_for(experiment(model, quant, extra=extra), jax.devices()[:1])
    params = with_seen_histories(jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"]))
    batch = packed_batch(np.random.default_rng(0))
    (loss, grads, _), _ = loss_and_grads(setup, params, batch)
    _REFERENCES[key] = params, batch, float(loss), jax.device_get(grads)
  return _REFERENCES[key]


def check_cell(model, layout, quant):
  ici, axes, preset, extra = LAYOUTS[layout]
  refused = REFUSED.get((model, layout))
  if refused is not None:
    with pytest.raises(ConfigError, match=refused):
      experiment(model, quant, ici, axes, preset, extra)
    return
  stages = 2 if layout == "pipeline_2" else 1
  # An MoE model in the pipeline: 2 units (4 layers) for 2 stages. Its balance and router z
  # losses are per microbatch (as with accumulation microbatches), its cross entropy over the
  # whole packed batch (unlike them): with those losses' weights 0, one device's run is the
  # reference; tests/test_pipeline_moe.py checks them against accumulation microbatches.
  moe_pp = stages > 1 and model != "dense"
  model_extra = (["model.num_layers=4", "model.moe.aux_loss_weight=0.0", "model.moe.z_loss_weight=0.0"]
                 if moe_pp else [])
  params, batch, ref_loss, ref_grads = reference(model, quant, model_extra)
  if stages > 1:
    params = dict(params, layers=pipeline.stage_params(params["layers"], stages, 1))
  setup = setup_for(experiment(model, quant, ici, axes, preset, [*model_extra, *extra]))
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  grads = jax.device_get(grads)
  if layout.startswith("dp_cp"):   # the asked-for attention ran: ring permutes K/V, all-gather does not
    permutes = [o for o in report.collectives(compiled.as_text())
                if o.kind == "collective-permute" and "shard_map" in o.op_name]
    assert bool(permutes) == layout.endswith("ring"), (model, layout, len(permutes))
  if stages > 1:
    grads = dict(grads, layers=pipeline.unstage_params(grads["layers"], 1))
  name = f"{model} x {layout} x {quant}"
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads), name
  if quant == "none":
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, err_msg=name)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=name)
    return
  np.testing.assert_allclose(float(loss), ref_loss, rtol=5e-4, err_msg=name)
  bound = 0.05 if model == "dense" else 0.15
  grads, histories = quantization.take_histories(grads)           # fp8_delayed: next amax histories
  ref_grads, ref_histories = quantization.take_histories(ref_grads)
  for h, r in zip(jax.tree.leaves(histories), jax.tree.leaves(ref_histories)):
    np.testing.assert_allclose(h, r, rtol=1e-3, err_msg=f"{name}: amax history")
  flat, ref_flat = ravel_pytree(grads)[0], ravel_pytree(ref_grads)[0]
  assert np.linalg.norm(flat - ref_flat) < bound * np.linalg.norm(ref_flat), name


@pytest.mark.parametrize("model,layout,quant", DIAGONAL)
def test_diagonal_cell_equals_one_device_or_is_refused(model, layout, quant):
  check_cell(model, layout, quant)


@pytest.mark.slow
@pytest.mark.parametrize("model,layout,quant", [c for c in CELLS if c not in DIAGONAL])
def test_every_cell_equals_one_device_or_is_refused(model, layout, quant):
  check_cell(model, layout, quant)


# model.remat='moe_matmuls' (layers/blocks.py) saves what it finds under the names
# 'expert_matmul' and the attention projections' names: in these cells those names sit on
# 8-bit matmul outputs, inside the expert-parallel and ring-attention shard_maps and inside a
# pipeline stage. A policy changes what is recomputed, never a value: each cell must equal
# the one-device run without remat. The first runs by default, the others with `-m slow`.
REMAT_CELLS = [("moe", "expert", "int8"), ("moe", "dp_cp_ring", "fp8_delayed"), ("dense", "pipeline_2", "int8")]


@pytest.mark.parametrize("model,layout,quant", [
    c if i == 0 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(REMAT_CELLS)])
def test_moe_matmuls_remat_cell_equals_one_device(model, layout, quant, monkeypatch):
  ici, axes, preset, extra = LAYOUTS[layout]
  monkeypatch.setitem(LAYOUTS, layout, (ici, axes, preset, [*extra, "model.remat='moe_matmuls'"]))
  check_cell(model, layout, quant)


@pytest.mark.slow
def test_moe_returned_remat_cell_equals_one_device(monkeypatch):
  """model.remat='moe_returned' saves the returned expert outputs inside the expert-parallel
  shard_map (one device has no exchange, so there it keeps the gate/up outputs only): equal."""
  ici, axes, preset, extra = LAYOUTS["expert"]
  monkeypatch.setitem(LAYOUTS, "expert", (ici, axes, preset, [*extra, "model.remat='moe_returned'"]))
  check_cell("moe", "expert", "int8")
