"""What the largest dense rows showed mispriced (docs/results/dense_large_pricing.md), priced from
the chips' physics: the splash kernel's matmuls on the MXU tile, host offload transfers on the
host link, the depth extrapolation of what lies outside the layer loop, and the HBM bytes of
an operand a fusion reads through windows."""

import copy
import dataclasses
import importlib.util
import json
import os

import pytest
from test_moe_pricing import StubExperiment, needs_libtpu, one_chip

from shardax.perf import costs, hardware, mxu, ops, stepmodel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _calibrate():
  spec = importlib.util.spec_from_file_location("calibrate", os.path.join(ROOT, "benchmarks", "calibrate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _llama70b_8k(**model):
  """The Llama-3.1-70B 8k row kept aside from the calibration (128-wide heads, remat)."""
  cal = _calibrate()
  row = copy.deepcopy(next(r for r in json.load(open(os.path.join(ROOT, "benchmarks", "heldout_runs.json")))
                           if r["id"] == "tpu-recipes-llama3.1-70b-8k-v6e-128"))
  row["model"].update(model)
  return cal._build(row, None)


def test_the_flash_kernel_runs_its_head_width_contractions_at_the_mxu_fill_of_the_chip():
  """By hand, for 128-wide heads on v6e's 256 x 256 MXU: of the kernel's matmul work per block
  pair (in units of 2 bq bkv 128 FLOPs) the forward runs S = QK^T (1 unit, contracting over the
  head: half the array, 2 units of time) and PV (1 unit, full); the backward S again (2 of
  time), dP = dO V^T (2 of time) and dV, dQ, dK (1 each). With remat the forward runs twice:
  9 units of work take 13 units of time. On a 128 MXU (v5e) every shape fills it; a 256-wide
  head fills v6e's too."""
  exp = _llama70b_8k()
  v6e, v5e = hardware.lookup("TPU v6 lite"), hardware.lookup("TPU v5 lite")
  flops = stepmodel.flash_kernel_flops(exp, 128)
  at_rate = lambda chip: flops / (ops.peak(chip, "bf16") * ops.efficiency(chip, "attention"))
  assert mxu.flash_kernel_fill(exp, 256) == pytest.approx(9 / 13)
  assert stepmodel.flash_kernel_seconds(exp, 128, v6e) == pytest.approx(at_rate(v6e) * 13 / 9)
  assert stepmodel.flash_kernel_seconds(exp, 128, v5e) == pytest.approx(at_rate(v5e))
  wide = _llama70b_8k(head_dim=256, num_heads=32, num_kv_heads=4)
  assert stepmodel.flash_kernel_seconds(wide, 128, v6e) == pytest.approx(
      stepmodel.flash_kernel_flops(wide, 128) / (ops.peak(v6e, "bf16") * ops.efficiency(v6e, "attention")))
  # the same rule as the program's own dots (perf/mxu.py): S on a 256 MXU at half
  assert mxu.utilization(512, 128, 512, 256) == 0.5 and mxu.utilization(512, 512, 128, 256) == 1.0


FIXTURES = os.path.join(ROOT, "tests", "fixtures", "peeled_offload")


def _costs(layers: int):
  import gzip
  from shardax.perf import costs
  with gzip.open(os.path.join(FIXTURES, f"layers_{layers}.hlo.gz"), "rt") as f:
    return costs.of_hlo_text(f.read())


def test_a_layer_loop_the_compiler_peels_is_deepened_to_the_deep_programs_count():
  """The TPU compiler runs the first backward layer of a stack that offloads its layer inputs to
  host memory outside the backward loop, at every depth: the 3-layer program's backward loop
  runs 2 times, the 6-layer one's 5 (tests/fixtures/peeled_offload: compiled v6e programs).
  Deepened from 3 to 6 layers, the backward loop runs 5 times and the step's FLOPs are the
  6-layer program's; read by the trip count alone, neither loop was a layer loop (the backward
  runs 2 != 3 times) and the deepened step kept the 3-layer FLOPs."""
  from shardax.perf import costs
  c3, c6 = _costs(3), _costs(6)
  assert sorted(l.trip_count for l in c3.loops) == [2, 3] and sorted(l.trip_count for l in c6.loops) == [5, 6]
  assert costs.layer_loop_trips(c3, 3) == {l.body: l.trip_count for l in c3.loops}
  deep = costs.deepen(c3, 3, 6, outside_scale=2.0)
  assert sorted(l.executions for l in deep.loops) == [5, 6]
  assert deep.flops == pytest.approx(c6.flops, rel=1e-3)
  assert deep.flops > 1.9 * c3.flops


def test_costs_cached_before_the_loop_state_was_read_deepen_as_before():
  """A cached Loop without `leading` (every calibration cache): a layer loop is one that runs
  `shallow` times and carries the stacked weights, as before."""
  from shardax.perf import costs
  old = costs._record(costs.Loop, {"body": "layers", "trip_count": 3, "executions": 3, "flops": 1.0,
                                   "bytes_accessed": 1.0, "stacked": 12})
  peeled = dataclasses.replace(old, body="backward", trip_count=2, executions=2, stacked=0)
  c = costs.Costs(0.0, 0.0, 0.0, (), (old, peeled), 0.0)
  assert costs.layer_loop_trips(c, 3) == {"layers": 3}


def test_offloaded_layer_inputs_cross_the_host_link_and_the_step_waits_for_them():
  """The 3-layer fixture offloads each layer's input, a [2048, 1024] bf16 slice per chip (4 MiB):
  read from the program, 4 dynamic-update-slices into the host buffer (one per forward layer, one
  more in the entry) and 3 dynamic-slices back (two in the backward loop, one for its peeled
  layer): 28 MiB a step over the host link. On a chip whose host link moves 100 MB/s the step
  cannot be shorter than those 0.29 s; before the transfers were read the step model left them
  out (a few ms)."""
  import numpy as np
  from shardax.sharding import topology
  if not topology.available():
    pytest.skip("needs libtpu (the test extra)")
  import jax
  c = _costs(3)
  moved = sum(p.executions * (p.host_bytes + p.host_sync_bytes) for p in c.pieces)
  assert moved == 28 * 2**20
  mesh = jax.sharding.Mesh(np.array(topology.devices("v6e:2x2")), ("d",))
  v6e = hardware.lookup("TPU v6 lite")
  slow = dataclasses.replace(v6e, host_bandwidth=1e8)
  fast = stepmodel.from_costs(c, mesh, StubExperiment, dataclasses.replace(v6e, host_bandwidth=1e15))
  pr = stepmodel.from_costs(c, mesh, StubExperiment, slow)
  assert moved / 1e8 <= pr.step_seconds <= moved / 1e8 + fast.step_seconds
  assert pr.breakdown["host_transfer"]["seconds"] == pytest.approx(moved / 1e8)
  # at v6e's own host link (15 GB/s a chip) the 28 MiB take 2 ms
  assert stepmodel.from_costs(c, mesh, StubExperiment, v6e).breakdown["host_transfer"]["seconds"] == pytest.approx(moved / 1.5e10)


def test_outside_the_layer_loops_only_the_stacks_traffic_grows_with_depth():
  """The entry of the 3-layer fixture runs the stack's [3, ...] arrays (gradients assembled,
  weights copied) beside depth-independent work (the loss, the peeled backward layer): about
  half of its HBM traffic each. Deepened to 6 layers by growing only the stack's share, its
  traffic is within 12% of the compiled 6-layer entry's; scaled whole by the parameter ratio
  (2x here, as before the split was read) it is 19% over, and further off than the split. Its
  collectives (the peeled layer's gathers, the input's exchange) are on no [L, ...] array: they
  stay, and the deepened step moves the 6-layer program's collective bytes (13% more before)."""
  from shardax.perf import costs
  c3, c6 = _costs(3), _costs(6)
  share = dict((d, s) for d, s, _ in c3.pieces[0].stacked)[3]
  assert 0.3 < share < 0.7
  split = costs.deepen(c3, 3, 6, outside_scale=2.0).pieces[0].hbm_bytes
  legacy = dataclasses.replace(c3, pieces=(dataclasses.replace(c3.pieces[0], stacked=()),) + c3.pieces[1:])
  whole = costs.deepen(legacy, 3, 6, outside_scale=2.0).pieces[0].hbm_bytes
  truth = c6.pieces[0].hbm_bytes
  assert split == pytest.approx(truth, rel=0.12)
  assert abs(split - truth) < abs(whole - truth) and whole > 1.15 * truth
  assert costs.deepen(c3, 3, 6, 2.0).collective_bytes == pytest.approx(c6.collective_bytes, rel=1e-3)
  assert costs.deepen(legacy, 3, 6, 2.0).collective_bytes > 1.1 * c6.collective_bytes


@pytest.mark.slow   # one compile in a fresh process, ~45 s on a busy 2-core machine
def test_the_fixture_is_what_this_libtpu_compiles(tmp_path):
  """tests/fixtures/peeled_offload/make.py at 3 layers with the installed libtpu still peels one
  backward layer out of its loop (2 of 3), as the fixtures were written."""
  import subprocess
  import sys
  from shardax.perf import hlo
  from shardax.sharding import topology
  if not topology.available():
    pytest.skip("needs libtpu (the test extra)")
  out = tmp_path / "layers_3.hlo"
  subprocess.run([sys.executable, os.path.join(FIXTURES, "make.py"), "3", str(out)], check=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert sorted(w.trip_count for w in hlo.whiles(hlo.parse(out.read_text()))) == [2, 3]


def _sliced_matmul(pad: bool) -> str:
  """x[:, window] @ w on one v5e chip, the window at a traced offset; `pad`: picked as the
  TPU compiler's windowed einsum picks a chunk of the layer input, the larger of two windows
  of a copy of x padded with -inf."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = one_chip("v5e:2x2")
  spec = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P()))

  def f(x, w, i):
    if not pad:
      return jax.lax.dynamic_slice(x, (0, i), (4096, 512)) @ w
    padded = jnp.pad(x[:, None, :], ((0, 0), (0, 1), (0, 0)), constant_values=-jnp.inf)
    return jnp.max(jax.lax.dynamic_slice(padded, (0, 0, i), (4096, 2, 512)), axis=1) @ w
  return jax.jit(f).lower(spec(4096, 4096), spec(512, 1024), spec(d=jnp.int32)).compile().as_text()


@needs_libtpu
def test_a_fusion_reads_only_the_windows_it_slices_out_of_an_operand():
  """By hand, on one v5e chip: x (32 MiB) is read only through one [4096, 2, 512] window of its
  padded copy (8 MiB, the pad's half included: an upper bound), w (1 MiB) is prefetched once and
  the product (8 MiB) written once: 17 MiB of HBM traffic. XLA counts x whole when a pad sits
  between the parameter and the slice (41 MiB): it made the 128B v5e row's windowed-einsum
  bodies memory-bound. Taken straight from x, the window is what the compiler prefetches all of
  x on chip for: x's 32 MiB are read, 41 MiB in all, as XLA counts."""
  mib = 2**20
  (windowed,) = costs.of_hlo_text(_sliced_matmul(pad=True)).pieces
  assert windowed.bytes_accessed == pytest.approx(53 * mib, rel=1e-3)   # XLA's count
  assert windowed.hbm_bytes == pytest.approx(17 * mib, rel=1e-3)
  (direct,) = costs.of_hlo_text(_sliced_matmul(pad=False)).pieces
  assert direct.hbm_bytes == pytest.approx(41 * mib, rel=1e-3)
