"""Matmul shapes against each chip's MXU (perf/mxu.py) and the dry run's error bar
(perf/error_bar.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.sharding import topology
from shardax.perf import hardware, costs, error_bar, mxu, step_report, stepmodel
from shardax.perf import hlo as perf_hlo
from shardax.perf.hlo import matmuls
from test_moe_pricing import StubExperiment, one_chip

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")


def _tpu_matmul(k: int) -> str:
  mesh = one_chip()
  x = jax.ShapeDtypeStruct((2048, k), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  w = jax.ShapeDtypeStruct((k, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  return jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text()


@needs_libtpu
def test_a_128_deep_matmul_fills_a_128_mxu_and_half_of_a_256_one():
  """Read from the TPU compiler's program (it writes the dot as a convolution): a contraction
  of 128 uses every multiply-add of a 128 x 128 array and half of v6e's 256 x 256; 256 fills both."""
  for k, want in ((128, {128: 1.0, 256: 0.5}), (256, {128: 1.0, 256: 1.0})):
    hlo = _tpu_matmul(k)
    (use,) = mxu.by_piece(hlo, costs.of_hlo_text(hlo).owner).values()
    assert use == pytest.approx(want), k


@needs_libtpu
def test_the_step_model_prices_padded_dots_on_the_chip_whose_mxu_pads_them():
  hlo = _tpu_matmul(128)
  c = costs.of_hlo_text(hlo)
  use = mxu.by_piece(hlo, c.owner)
  mesh = one_chip()
  for name, slower in (("TPU v6 lite", 2.0), ("TPU v5 lite", 1.0)):
    chip = hardware.lookup(name)
    padded = stepmodel.from_costs(c, mesh, StubExperiment, chip, use).breakdown["compute_seconds"]
    plain = stepmodel.from_costs(c, mesh, StubExperiment, chip, None).breakdown["compute_seconds"]
    assert padded == pytest.approx(slower * plain), name


def _summary(tmp_path, rows):
  path = tmp_path / "errors.json"
  error_bar.write(rows, str(path))
  return str(path)


def test_the_error_bar_is_the_chips_own_calibration_or_says_there_is_none(tmp_path):
  path = _summary(tmp_path, {"a": ("TPU v5", 1.1), "b": ("TPU v5", 0.8), "c": ("TPU v5", 1.0),
                             "d": ("TPU v4", 1.02), "e": ("NVIDIA H100 80GB HBM3", 1.3)})
  own = error_bar.for_chip(hardware.lookup("TPU v5"), path)
  assert (own["rows"], own["median"], own["worst"]) == (3, pytest.approx(1.1), pytest.approx(1.25))
  v5e = error_bar.for_chip(hardware.lookup("TPU v5 lite"), path)
  # v5e's FLOP/byte (197e12 / 819e9 = 241) is nearest v4's (275e12 / 1.2e12 = 229), not the H100's
  assert v5e["rows"] == 0 and v5e["nearest"] == "TPU v4"
  assert "v5e: no calibrated runs; expect larger error" in v5e["line"]
  assert "no summary" in error_bar.for_chip(hardware.lookup("TPU v4"), str(tmp_path / "none.json"))["line"]


def test_the_interval_is_students_t_on_log_ratios_with_one_more_run_in_its_width():
  """Three ratios e^-0.1, 1, e^0.1: log mean 0, stdev 0.1; t(0.95, 2 df) = 2.919986 (t tables);
  a new run's spread adds the mean's: sqrt(1 + 1/3)."""
  import math
  lo, hi = error_bar.interval([math.exp(-0.1), 1.0, math.exp(0.1)])
  half = 2.919986 * 0.1 * math.sqrt(4 / 3)
  assert (math.log(lo), math.log(hi)) == (pytest.approx(-half, rel=1e-6), pytest.approx(half, rel=1e-6))
  assert error_bar.interval([1.1]) is None   # one run gives no spread


def test_a_rows_own_error_never_enters_the_bar_it_is_checked_against():
  """Leave-one-out: row 'x' is judged by the interval of the other rows of its chip, so making
  its error absurd changes its own bar not at all (and fails its check), while the bars of
  the rows beside it, and the family's interval for a new run, widen."""
  rows = {"a": ("TPU v5", 1.05), "b": ("TPU v5", 0.97), "c": ("TPU v5", 1.10), "d": ("TPU v5", 1.01),
          "x": ("TPU v5", 1.04), "other": ("TPU v4", 1.5)}
  before = error_bar.leave_one_out(rows)
  after = error_bar.leave_one_out({**rows, "x": ("TPU v5", 3.0)})
  assert after["x"]["loo"] == before["x"]["loo"] and before["x"]["inside"] and not after["x"]["inside"]
  assert after["x"]["loo"] == list(error_bar.interval([1.05, 0.97, 1.10, 1.01]))
  for rid in "abcd":
    assert after[rid]["loo"][1] > before[rid]["loo"][1], rid
  assert before["other"]["loo"] is None   # alone in its family: nothing to check it against
  fam = error_bar.summary({**rows, "x": ("TPU v5", 3.0)})["families"]["TPU v5"]
  assert (fam["loo_inside"], fam["loo_checked"]) == (4, 5) and fam["interval"][1] > 1.5


def test_the_dry_runs_printed_prediction_carries_the_error_bar(tmp_path, monkeypatch):
  monkeypatch.setattr(error_bar, "ERRORS", _summary(tmp_path, {"a": ("TPU v5", 1.2), "b": ("TPU v5", 1.0),
                                                                "c": ("TPU v5", 1.1)}))
  pr = stepmodel.Prediction(step_seconds=1.0, mfu=0.5, hfu=0.5, tokens_per_second_per_device=1.0,
                            chip="TPU v6 lite", model_flops_per_step=1.0, hardware_flops_per_device=1.0,
                            flops_convention="6N", breakdown={
                                "compute_seconds": 1.0, "memory_seconds": 0.1, "bubble_seconds": 0.0,
                                "recompute_factor": 1.0, "matmul_efficiency": 0.8,
                                "collectives": {"by_kind": {}, "by_axis": {}, "by_link": {},
                                                "exposed_seconds": 0.0, "hidden_seconds": 0.0}})
  lines = step_report.format_prediction(pr)
  lo, hi = error_bar.interval([1.2, 1.0, 1.1])
  assert "predicted step" in lines[0]
  assert "v6e: no calibrated runs; expect larger error" in lines[1] and "v5p: 3 runs, error median 1.10x" in lines[1]
  assert f"90% interval for a new run's pred/pub {lo:.2f}x-{hi:.2f}x" in lines[1]
  assert "inside the others' interval: 3 of 3" in lines[1]   # two rows at t(1 df) = 6.3: wide bars


def _fsdp_scan_grad(slice_name: str) -> str:
  """The gradient of a scanned 4-layer matmul stack with its weights split over 4 chips (FSDP)."""
  from shardax.sharding import topology as topo
  mesh = jax.sharding.Mesh(np.array(topo.devices(slice_name)), ("d",))
  x = jax.ShapeDtypeStruct((8, 256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
  w = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "d")))
  f = lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()
  return jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile().as_text()


@needs_libtpu
def test_v5e_async_collective_fusions_are_one_async_transfer_each():
  """libtpu writes v5e's overlapped all-gathers as async collective fusions: a start fusion, slices
  inside a compute fusion and a done fusion, each repeating the all-gather. Read as three
  synchronous all-gathers they tripled the bytes and were all exposed; read as one async
  transfer, the same program moves the same all-gather bytes per step as on v5p (which keeps
  them synchronous), and some of v5e's run under compute."""
  from shardax.sharding import report
  moved = {}
  for name in ("v5e:2x2", "v5p:2x2x1"):
    found = [c for c in report.collectives(_fsdp_scan_grad(name)) if c.kind == "all-gather"]
    moved[name] = sum(c.bytes * c.executions for c in found)
    if name.startswith("v5e"):
      assert any(c.is_async for c in found)
  assert moved["v5e:2x2"] == moved["v5p:2x2x1"] > 0


def test_a_dot_written_as_a_windowed_convolution_contracts_over_its_taps():
  """From a compiled v5e program (the MID model of test_dry_run at batch 64): a 128-deep dot
  written as 64 input features x a window of 2 taps. Read as 64 deep it was 'half empty' on a
  128 MXU (the step model priced it 2x slow); the taps accumulate into the same outputs."""
  hlo = """  %a = bf16[1,1024,2,64]{3,2,1,0} parameter(0)
  %b = bf16[2,64,2048,1]{3,2,1,0} parameter(1)
  ROOT %convolution.228 = bf16[8,128,2048,1]{2,1,0,3} convolution(%a, %b), window={size=2x1}, dim_labels=1b0f_0io1->1bf0"""
  [mm] = matmuls.matmuls(perf_hlo.parse(hlo))
  m, k, n = mm.mnk
  assert (k, n) == (128, 2048) and mxu.utilization(m, k, n, 128) == 1.0


def test_a_padded_window_dim_is_a_diagonal_not_depth():
  """From the same program: attention over 4 heads written as a window whose heads dim is
  padded (3_3: one real tap per output) beside an unpadded 2-tap split of a 128-deep dot."""
  hlo = """  %a = bf16[128,8,2,64,4]{4,3,2,1,0} parameter(0)
  %b = bf16[2,64,4,128,1]{4,3,2,1,0} parameter(1)
  ROOT %convolution.222 = bf16[8,128,4,128,1]{3,1,4,2,0} convolution(%a, %b), window={size=1x4x2 pad=0_0x3_3x0_0 rhs_reversal=0x1x0}, dim_labels=0b2f1_2i1o0->0b1f2"""
  [mm] = matmuls.matmuls(perf_hlo.parse(hlo))
  assert mm.mnk[1] == 128


def test_strided_dilated_window_dims_are_diagonals_not_depth():
  """Llama-2 7B's QK^T ('bqkgd,bskd->bkgqs') as libtpu compiled it for v6e: heads and kv
  groups as a 4 x 32 window with stride and lhs dilation, over a 128-deep contraction: half
  of a 256 MXU (counted as depth, it read 16384 deep and full)."""
  hlo = """  %q = bf16[4,4096,32,128]{1,3,2,0} parameter(0)
  %k = bf16[4,4096,32,128]{1,3,2,0} parameter(1)
  ROOT %convolution-base-dilated.23 = f32[4,32,4096,4096]{3,2,1,0} convolution(%q, %k), window={size=4x32 stride=3x31 lhs_dilate=4x32}, dim_labels=0b1f_0o1i->01bf"""
  [mm] = matmuls.matmuls(perf_hlo.parse(hlo))
  m, k, n = mm.mnk
  assert k == 128 and mxu.utilization(m, k, n, 256) == 0.5
