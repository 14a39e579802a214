"""The step model's roofline guard: no predicted step is faster than the model FLOPs it trains at
the chips' peak, or than the HBM traffic its training state needs (perf/stepmodel.py)."""

import jax
import numpy as np
import pytest

from shardax import configs
from shardax.perf import hardware, costs, dry_run, step_report, stepmodel

V5E = hardware.lookup("TPU v5 lite")

# A step program as the costs read it: `trips` iterations of one [n, n] x [n, n] matmul.
PROGRAM = """HloModule m

%cond (p: (s32[], f32[N,N])) -> pred[] {
  %p = (s32[], f32[N,N]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(TRIPS)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[N,N])) -> (s32[], f32[N,N]) {
  %p = (s32[], f32[N,N]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[N,N] get-tuple-element(%p), index=1
  %d = f32[N,N] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[N,N]) tuple(%j, %d)
}

ENTRY %main (x: f32[N,N]) -> f32[N,N] {
  %x = f32[N,N] parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[N,N]) tuple(%zero, %x)
  %w = (s32[], f32[N,N]) while(%t0), condition=%cond, body=%body
  ROOT %y = f32[N,N] get-tuple-element(%w), index=1
}
"""


def program(n: int, trips: int) -> costs.Costs:
  return costs.of_hlo_text(PROGRAM.replace("TRIPS", str(trips)).replace("N,N", f"{n},{n}"))


@pytest.fixture(scope="module")
def exp():
  """lm.tiny at a small size: ~6e9 model FLOPs a step (batch 8 x 32 tokens)."""
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, ["data.source='synthetic'", "model.num_layers=2", "model.d_model=256",
                                "model.num_heads=4", "model.d_ff=1024", "data.seq_len=32", "model.max_len=32",
                                "train.global_batch=8", "mesh.ici=(1,1)"])
  return configs.build(cfg)


@pytest.fixture(scope="module")
def mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))


def model_flops(exp) -> float:
  return exp.model.flops_per_example(exp.data) * exp.train.global_batch


def test_a_step_whose_costs_miss_the_models_work_is_refused_naming_the_terms(exp, mesh):
  """The costs hold a tenth of the model's FLOPs (a kernel they price at 0, a loop counted too
  few times): the step would come out above 100% MFU. It is refused, not clipped."""
  n = 512
  short = program(n, trips=max(1, int(0.1 * model_flops(exp) / (2 * n ** 3))))
  assert short.flops < 0.2 * model_flops(exp)
  with pytest.raises(stepmodel.ImpossiblePrediction) as e:
    stepmodel.from_costs(short, mesh, exp, V5E)
  refused = e.value.prediction
  assert refused.mfu > 1.0                       # the figure that cannot be true
  assert refused.step_seconds < e.value.roofline["model_flops_seconds"]
  message = str(e.value)
  for term in ("predicted step", "model FLOPs time at peak", "HBM floor", "refused"):
    assert term in message, (term, message)
  assert f"{refused.step_seconds:.4g} s" in message
  assert isinstance(e.value, ValueError)         # the CLI reports it in one line


def test_the_same_step_with_its_work_counted_is_priced(exp, mesh):
  n = 512
  full = program(n, trips=int(2 * model_flops(exp) / (2 * n ** 3)) + 1)
  assert full.flops > model_flops(exp)
  pr = stepmodel.from_costs(full, mesh, exp, V5E)
  bound = pr.breakdown["roofline"]
  assert 0 < bound["seconds"] <= pr.step_seconds and pr.mfu < 1.0
  assert any(line.strip().startswith("roofline ") for line in step_report.format_prediction(pr))


def test_a_step_faster_than_reading_and_writing_its_state_is_refused(exp, mesh):
  """Enough FLOPs, but the training state each device holds (here 8 GiB: parameters and
  optimizer state) cannot be read and written back in that time at v5e's HBM bandwidth."""
  full = program(512, trips=int(2 * model_flops(exp) / (2 * 512 ** 3)) + 1)
  assert stepmodel.from_costs(full, mesh, exp, V5E).step_seconds < 2 * 8 * 2**30 / V5E.hbm_bandwidth
  with pytest.raises(stepmodel.ImpossiblePrediction, match="HBM floor") as e:
    stepmodel.from_costs(full, mesh, exp, V5E, state_bytes_per_device=8 * 2**30)
  bound = e.value.roofline
  assert bound["seconds"] == bound["hbm_floor_seconds"] > bound["model_flops_seconds"]
  # without the dry run's exact state bytes, the floor is the parameters' (param_count)
  assert stepmodel.roofline(exp, 1, V5E)["hbm_floor_bytes"] >= exp.model.param_count() * 4


def test_a_refused_prediction_is_marked_in_the_dry_run_report(exp, mesh):
  """The dry run keeps its memory report and says, in place of the predicted step, that the
  step model's figure was refused and why (price(): what dry_run and extrapolate call)."""
  out = {"bytes_per_device": {"params": 10, "optimizer_state": 20}}
  assert dry_run.price(out, program(64, 1), mesh, exp, V5E, None, flash_kernel=False) is None
  assert out["predicted"] is None
  refused = out["prediction_refused"]
  assert refused["step_seconds"] < refused["roofline"]["seconds"]
  assert "model FLOPs time at peak" in refused["message"]
  report = dict(out, experiment="e", topology=None, num_devices=1, device_kind="TPU v5 lite",
                mesh={"data": 1}, num_params=1, global_batch=8, tokens_per_step=256,
                compile_seconds=1.0, compile_cpu_seconds=1.0, hbm_bytes_per_device=None, fits=None,
                error=None, buffers=[], flops_per_device=None, collectives={}, hint=None)
  report["bytes_per_device"] = {"params": 10, "optimizer_state": 20, "temp": 0, "total": 30}
  assert f"PREDICTION REFUSED: {refused['message']}" in dry_run.format_report(report)
  assert "refused (under the roofline)" in dry_run.markdown_table([report])
