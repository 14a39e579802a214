"""Llama 4's pieces on the paths of a sharded run: interleaved RoPE, the weightless q/k norm,
chunked-RoPE and NoPE-with-temperature layers, the sigmoid top-1 gate on the expert's input
with a shared expert. A pipelined, expert-parallel run equals one device's accumulation
microbatches, and context parallelism (all-gather, ring) equals one device.
(tests/test_hf_llama4.py checks the pieces against transformers.)
"""

import jax
import numpy as np
import pytest

from shardax import pipeline
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, setup_for
from test_layer_pattern import assert_context_parallel_equals_one_device
from test_pipeline_moe import BATCH, M, experiment

LLAMA4 = ["model.rope_interleave=True", "model.qk_l2_norm=True", "model.temperature_floor_scale=4.0",
          "model.temperature_scale=0.5"]
LLAMA4_MOE = LLAMA4 + [
    "model.layer_pattern=({'chunk': 4}, {'chunk': 4}, {'chunk': 4}, {'rope': False, 'temperature_tuning': True})",
    "model.moe.every=2", "model.moe.first_dense_layers=0", "model.moe.top_k=1", "model.moe.score='sigmoid'",
    "model.moe.renormalize=False", "model.moe.gate_input=True", "model.moe.num_shared_experts=1",
    "model.moe.dispatch='dropless'", "model.moe.bias_update_rate=0.0", "model.moe.n_group=1",
    "model.moe.topk_group=1", "model.moe.aux_loss_weight=0.0"]


@pytest.mark.slow   # ~30 s alone (two compiles of an 8-layer MoE step on 8 devices)
def test_pipelined_expert_parallel_llama4_equals_one_device():
  """8 layers (2 units of the 4-kind pattern, MoE every 2nd) in 2 stages x 4 microbatches on
  (stage 2, data 4) with the experts split over data: loss and grads equal the unpipelined
  model on one device with 4 accumulation microbatches."""
  ref = setup_for(experiment("moe.deepseek_tiny", 8, accum=M, extra=LLAMA4_MOE), jax.devices()[:1])
  assert ref.exp.model.moe.gate_input and ref.exp.model.num_stack_units == 2
  params = jax.device_get(state_lib.init_fn(ref)(jax.random.key(0))["params"])
  tokens = np.random.default_rng(0).integers(1, 256, size=(BATCH, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, _), _ = loss_and_grads(ref, params, batch)

  setup = setup_for(experiment("moe.deepseek_tiny", 8, 2, 1, (2, 4), ("stage", "data"), "pp_expert",
                               extra=LLAMA4_MOE))
  staged = dict(params, layers=dict(params["layers"], blocks=pipeline.stage_params(
      params["layers"]["blocks"], 2, 1)))
  (p_loss, p_grads, _), _ = loss_and_grads(setup, staged, batch)
  p_grads = jax.device_get(p_grads)
  p_grads["layers"]["blocks"] = pipeline.unstage_params(p_grads["layers"]["blocks"], 1)
  np.testing.assert_allclose(p_loss, loss, rtol=1e-5)
  flat, ref_flat = jax.tree.leaves(p_grads), jax.tree.leaves(grads)
  assert len(flat) == len(ref_flat) > 8
  for g, r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("mode", ["allgather", "ring"])
def test_context_parallel_llama4_attention_equals_one_device(mode):
  """Interleaved RoPE and the q/k norm on RoPE layers beside a NoPE layer with the temperature
  (no chunk: refused under context parallelism) on (data 2, context 4) with packed rows: loss
  and grads equal one device's."""
  assert_context_parallel_equals_one_device(LLAMA4 + [
      "model.layer_pattern=({}, {'rope': False, 'temperature_tuning': True})", f"model.context_parallel={mode!r}"])
