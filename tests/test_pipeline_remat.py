"""Remat policies inside a pipeline stage: each one is mapped to what it means there, or
refused at config build time by name, and none recomputes a stage twice.

The pipeline checkpoints every iteration's stage computation (pipeline/loop.py), so the
backward pass already recomputes each stage once from its saved input. A block policy
inside that recompute only decides what the recomputed iteration keeps; an offload policy
means the saved stage inputs, stacked over the iterations, live in host memory.
"""

import dataclasses
import re

import jax
import numpy as np
import pytest

from shardax import configs, pipeline
from shardax.configs.schema import REMAT_CHOICES, ConfigError
from shardax.sharding import use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from shardax.perf import costs as costs_lib
from meshtools import equations, loss_and_grads, setup_for, tiny_lm

STAGES, MICRO, LAYERS, BATCH = 4, 4, 8, 32
ITERATIONS = MICRO + STAGES - 1
PIPE = dict(ici=(4, 2), axes=("stage", "data"), preset="pp_dp")


def _exp(remat: str):
  return tiny_lm(LAYERS, BATCH, STAGES, MICRO, extra=[f"model.remat={remat!r}"], **PIPE)


def _refusal(remat: str) -> str | None:
  try:
    _exp(remat)
  except ConfigError as e:
    return str(e)
  return None


def _flops(exp) -> float:
  setup = setup_for(exp)
  fn = jax.jit(lambda p, b: step_lib.grads_and_loss(setup, p, b)[:2],
               in_shardings=(setup.shardings["params"], setup.batch_sharding),
               out_shardings=(setup.replicated, setup.shardings["params"]))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    return costs_lib.of_compiled(fn.lower(setup.abstract["params"], step_lib.abstract_batch(setup)).compile()).flops


def _saved_stage_inputs(exp) -> list:
  """What the pipeline loop stacks over its iterations with a stage input's shape
  ([T, S, rows, length, embed]), read from the gradient's jaxpr: the saved stage inputs."""
  setup = setup_for(exp)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    jaxpr = jax.make_jaxpr(lambda p, b: step_lib.grads_and_loss(setup, p, b))(
        setup.abstract["params"], step_lib.abstract_batch(setup))
  shape = (ITERATIONS, STAGES, BATCH // MICRO, exp.data.seq_len, exp.model.d_model)
  return [v.aval for e in equations(jaxpr.jaxpr) if e.primitive.name == "scan" and e.params["length"] == ITERATIONS
          for v in e.outvars if getattr(v.aval, "shape", None) == shape]


def _on_host(aval) -> bool:
  return "host" in str(getattr(aval, "memory_space", "")).lower()


def test_each_policy_is_mapped_or_refused_by_name():
  """Every model.remat choice builds a pipelined config, or is refused naming the field,
  the stages and a policy that works there; 'offload_proj' and 'offload_qkv' are refused (their
  projections would go to host and back within one iteration), 'offload' is mapped."""
  refused = {r: _refusal(r) for r in REMAT_CHOICES}
  for remat, msg in refused.items():
    if msg is not None:
      assert f"model.remat={remat!r}" in msg and "model.pipeline.stages=4" in msg, msg
      assert "model.remat='offload'" in msg and "model.remat='full'" in msg, msg
  assert [r for r, msg in refused.items() if msg] == ["offload_proj", "offload_qkv"]
  tiny_lm(LAYERS, BATCH, extra=["model.remat='offload_proj'"])   # unpipelined: still a choice
  with pytest.raises(pipeline.PipelineError, match="model.remat='offload_proj'"):
    pipeline.stage_remat("offload_proj", 2)


def test_offload_keeps_the_saved_stage_inputs_in_host_memory():
  """remat='offload' in a pipeline: the stage inputs the loop saves for the backward pass,
  one per iteration, are stacked in host memory (remat='full' keeps them on the device).
  Fails when the offload is left to the block remat inside the stage: the per-iteration
  checkpoint then saves the stage inputs on the device and the block's offload is undone."""
  full, offload = _saved_stage_inputs(_exp("full")), _saved_stage_inputs(_exp("offload"))
  assert full and not any(_on_host(a) for a in full), full
  assert offload and all(_on_host(a) for a in offload), offload


@pytest.mark.parametrize("remat", [r for r in REMAT_CHOICES if r not in ("none", "full")])
def test_no_policy_recomputes_a_stage_twice(remat):
  """The per-iteration checkpoint is the one recompute: every policy a pipeline accepts
  compiles to the FLOPs of remat='none' (4 forward-equivalents), not one more forward of
  some layers on top (offload: 1.19x, offload_proj 1.11x, moe_matmuls / moe_returned on a
  dense model 1.11x when they ran as given inside the recomputed stage)."""
  if _refusal(remat) is not None:
    pytest.skip(f"model.remat={remat!r} is refused in a pipeline")
  flops = {r: _flops(_exp(r)) for r in ("none", remat)}
  assert flops[remat] < 1.05 * flops["none"], flops


def test_offload_gives_the_gradients_of_full_remat():
  """The offloaded stage inputs come back unchanged: loss and gradients equal remat='full'."""
  out = {}
  for remat in ("full", "offload"):
    setup = setup_for(_exp(remat))
    if not out:
      params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
      tokens = np.random.default_rng(0).integers(1, 256, size=(BATCH, 17)).astype(np.int32)
      batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    out[remat] = loss_and_grads(setup, params, batch)[0][:2]
  np.testing.assert_allclose(out["offload"][0], out["full"][0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), out["offload"][1], out["full"][1])


# 2 stages x 4 microbatches on v5e:2x2 (stage=2, data=2): T = 5 iterations, each saving a
# stage input of [stage 1, rows 4, length 512, embed 128] bf16 per chip.
TPU = ["data.source='synthetic'", "model.num_layers=8", "model.d_model=128", "model.num_heads=4",
       "model.d_ff=256", "data.seq_len=512", "model.max_len=512", "train.global_batch=32",
       "model.pipeline.stages=2", "model.pipeline.microbatches=4", "model.dtype='bfloat16'",
       "mesh.axes=('stage','data')", "mesh.ici=(2,2)", "mesh.topology='v5e:2x2'",
       "mesh.num_cpu_devices=None", "sharding.preset='pp_dp'"]
SAVED_INPUTS = re.compile(r"bf16\[5,1,4,512,128\]\{([^}]*)\}")


@pytest.fixture(scope="module")
def tpu_compiles():
  """remat -> (experiment, compiled step, its buffer list) on v5e:2x2: 'full' with the buffer
  list the levers read, 'offload' without (~15 s and ~8 s of compile on a quiet 2-core host)."""
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  out = {}
  for remat in ("full", "offload"):
    cfg = configs.get("lm.tiny")
    configs.apply_overrides(cfg, [*TPU, f"model.remat={remat!r}"])
    exp = configs.build(cfg)
    _, setup = dry_run.prepare(exp)
    out[remat] = ((exp, *dry_run.compile_with_buffers(setup, top=12)) if remat == "full" else
                  (exp, dry_run.compile_step(setup), None))
  return out


def test_offload_puts_the_stage_inputs_in_host_memory_on_a_tpu_compile(tpu_compiles):
  """The TPU compiler places the stacked stage inputs in host memory (layout tag S(5)) and
  the program's host bytes are exactly theirs; with remat='full' they stay on the device."""
  from shardax.perf import dry_run
  full, offload = tpu_compiles["full"][1], tpu_compiles["offload"][1]
  on_device = set(SAVED_INPUTS.findall(full.as_text()))
  assert on_device and not any("S(5)" in l for l in on_device), on_device
  on_host = set(SAVED_INPUTS.findall(offload.as_text()))
  assert on_host and all("S(5)" in l for l in on_host), on_host
  assert dry_run.host_temp_bytes(offload) == 5 * 4 * 512 * 128 * 2


def test_levers_offer_offload_for_the_saved_stage_inputs(tpu_compiles):
  """The dry run's levers offer a pipelined remat='full' config the offload of its saved stage
  inputs ([iterations, stage, rows, length, embed]), for the bytes the offload compile then
  keeps in host memory; the lever's --set builds."""
  from shardax.perf import dry_run, levers
  exp, _, buffers = tpu_compiles["full"]
  offered = {l.setting: l for l in levers.rank(exp, {}, [dataclasses.asdict(b) for b in buffers])}
  assert "model.remat='offload'" in offered, offered
  assert offered["model.remat='offload'"].saves == dry_run.host_temp_bytes(tpu_compiles["offload"][1])
  _exp(offered["model.remat='offload'"].setting.split("=", 1)[1].strip("'"))


def test_levers_never_offer_a_policy_the_pipeline_refuses(tpu_compiles, monkeypatch):
  """A remat lever is offered only where the config would accept it: with 'offload' refused in
  pipelines (as 'offload_proj' is), the same buffers get no offload lever."""
  from shardax.configs import pipeline as pipeline_config
  from shardax.perf import levers
  exp, _, buffers = tpu_compiles["full"]
  monkeypatch.setitem(pipeline_config.REMAT_REFUSED_IN_PIPELINE, "offload", "refused for this test")
  offered = [l.setting for l in levers.rank(exp, {}, [dataclasses.asdict(b) for b in buffers])]
  assert offered and not [s for s in offered if "remat" in s], offered
