"""Dry runs from shallow copies of a scanned stack (perf/extrapolate.py)."""

import json

import jax
import pytest

from shardax import configs
from shardax.perf import extrapolate as ex

SMALL = ["data.source='synthetic'", "model.num_heads=4", "model.d_model=128", "model.d_ff=512",
         "data.seq_len=64", "model.max_len=64", "train.global_batch=8", "sharding.preset='2d'",
         "model.remat='full'", "mesh.topology='v5e:2x2'", "mesh.ici=(2,2)"]


def build(name, *overrides):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, list(overrides))
  return configs.build(cfg)


def test_affine_is_exact_on_ints_fills_missing_keys_and_clamps():
  a = {"bytes": 100, "kinds": {"all-gather": {"count": 3}}, "chip": "a"}
  b = {"bytes": 150, "kinds": {"all-gather": {"count": 5}, "all-reduce": {"count": 2}}, "chip": "b",
       "fits": True}
  out = ex.affine(a, b, 3, 4, 104)
  assert out == {"bytes": 100 + 50 * 101, "chip": "b", "fits": True,
                 "kinds": {"all-gather": {"count": 3 + 2 * 101}, "all-reduce": {"count": 2 * 101 + 2 - 2}}}
  assert ex.affine(10**12 + 7, 2 * 10**12 + 7, 1, 2, 104) == 104 * 10**12 + 7  # exact, no float rounding
  assert ex.affine(1.0, 1.5, 3, 4, 6) == pytest.approx(2.5)
  assert ex.affine(10, 5, 3, 4, 104) == 0  # a shrinking byte count cannot go negative


def test_depth_unit_is_a_layer_a_pipeline_round_or_a_moe_unit():
  assert ex.depth(build("lm.tiny", "model.num_layers=12")) == ex.Depth(12, 1, "model.num_layers")
  gpt3 = build("lm.gpt3_175b_pipelined")
  assert ex.depth(gpt3) == ex.Depth(96, 16, "model.num_layers")  # 4 stages x 4 circular repeats
  shallow = ex.with_layers(gpt3, 48)
  assert shallow.model.num_layers == 48 and shallow.model.pipeline == gpt3.model.pipeline
  assert shallow.mesh == gpt3.mesh and shallow.train == gpt3.train
  moe = build("moe.gshard_1t")
  assert ex.depth(moe) == ex.Depth(40, 2, "model.num_layers")
  assert ex.with_layers(moe, 6).model.num_layers == 6
  assert ex.with_layers(moe, 6).model.moe == moe.model.moe
  # a pipelined MoE model: one unit (dense + MoE block) per stage per visit, after the first dense
  pp_moe = build("moe.deepseek_tiny", "model.num_layers=41", "model.moe.every=2", "model.pipeline.stages=2",
                 "model.pipeline.microbatches=2", "model.pipeline.circular_repeats=2")
  assert ex.depth(pp_moe) == ex.Depth(41, 8, "model.num_layers", 1)
  assert "scan_layers=False" in ex.depth(build("lm.tiny", "model.num_layers=12", "model.scan_layers=False"))
  assert "already as shallow" in ex.depth(build("lm.tiny", "model.num_layers=4"))


def test_compile_effort_is_set_inside_the_block_only():
  # jax 0.10: exec_time_optimization_effort; jax 0.11 dropped it for the optimization level.
  key = ("jax_exec_time_optimization_effort" if hasattr(jax.config, "jax_exec_time_optimization_effort")
         else "jax_optimization_level")
  before = getattr(jax.config, key)
  with ex.compile_effort(-1.0):
    assert getattr(jax.config, key) in (-1.0, "O0")
  assert getattr(jax.config, key) == before
  assert [ex._optimization_level(e) for e in (-1, -0.2, 0, 0.2, 1)] == ["O0", "O1", "UNKNOWN", "O2", "O3"]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
  """One 12-layer model: extrapolated from 3 and 4 layers, and compiled whole (both at effort -1)."""
  pytest.importorskip("libtpu")
  exp = build("lm.tiny", *SMALL, "model.num_layers=12")
  job = tmp_path_factory.mktemp("extrapolated")
  shallow = ex.dry_run(exp, str(job), effort=-1.0)
  full = ex.dry_run(exp, full=True, effort=-1.0)
  return shallow, full, job


def test_extrapolation_matches_the_full_compile_within_5_percent(both):
  shallow, full, _ = both
  assert shallow["compile_path"] == "shallow" and shallow["shallow"]["layers"] == [3, 4]
  assert full["compile_path"] == "full"
  # Exactly affine in depth: params, optimizer state, parameter count, model FLOPs.
  for key in ("params", "optimizer_state"):
    assert shallow["bytes_per_device"][key] == full["bytes_per_device"][key]
  assert shallow["num_params"] == full["num_params"]
  assert shallow["model_flops_per_step"] == full["model_flops_per_step"]
  for key in ("argument", "total"):
    assert shallow["bytes_per_device"][key] == pytest.approx(full["bytes_per_device"][key], rel=0.05)
  ps, pf = shallow["predicted"], full["predicted"]
  for key in ("step_seconds", "mfu", "tokens_per_second_per_device"):
    assert ps[key] == pytest.approx(pf[key], rel=0.05), key
  for kind, c in full["collectives"].items():  # loop-body collectives run once per layer
    assert shallow["collectives"][kind]["count"] == pytest.approx(c["count"], rel=0.05), kind
  assert shallow["fits"] is full["fits"] is True


def test_an_moe_stack_after_dense_layers_extrapolates_its_unit_loop():
  """DeepSeek-V3's shape: 2 dense layers in their own loop, then the MoE units' loop. The
  shallow copies (5 and 6 layers) run that loop 3 and 4 times, not 5 and 6: deepened by the
  layer count instead (before 2026-11-26), no loop matched and the 10-layer prediction kept
  the 6-layer copy's FLOPs (moe.deepseek_v3 --shallow: MFU 172%)."""
  pytest.importorskip("libtpu")
  exp = build("moe.tiny", *SMALL, "model.num_layers=10", "model.moe.every=1",
              "model.moe.first_dense_layers=2")
  assert ex.depth(exp) == ex.Depth(10, 1, "model.num_layers", offset=2)
  shallow, full = ex.dry_run(exp, effort=-1.0), ex.dry_run(exp, full=True, effort=-1.0)
  assert shallow["compile_path"] == "shallow" and shallow["shallow"]["layers"] == [5, 6]
  ps, pf = shallow["predicted"], full["predicted"]
  assert ps["hardware_flops_per_device"] == pytest.approx(pf["hardware_flops_per_device"], rel=0.05)
  assert ps["step_seconds"] == pytest.approx(pf["step_seconds"], rel=0.05)


@pytest.mark.slow
def test_a_layer_pattern_stack_is_cut_in_whole_units_and_keeps_its_tail():
  """A 3-kind pattern over 20 layers (6 scanned units and a tail of 2): the shallow copies are
  3 and 4 whole units plus the tail (11 and 14 layers), whose scan runs 3 and 4 times; cut
  per layer they would not even build (3 layers < a unit) or run a loop of the wrong count."""
  pytest.importorskip("libtpu")
  exp = build("lm.tiny", *SMALL, "model.num_layers=20",
              "model.layer_pattern=({'window': 8}, {'window': 8}, {'rope_theta': 1e6})")
  assert ex.depth(exp) == ex.Depth(20, 3, "model.num_layers", offset=2)
  shallow, full = ex.dry_run(exp, effort=-1.0), ex.dry_run(exp, full=True, effort=-1.0)
  assert shallow["compile_path"] == "shallow" and shallow["shallow"]["layers"] == [11, 14]
  ps, pf = shallow["predicted"], full["predicted"]
  assert ps["hardware_flops_per_device"] == pytest.approx(pf["hardware_flops_per_device"], rel=0.05)
  assert ps["step_seconds"] == pytest.approx(pf["step_seconds"], rel=0.05)


def test_report_says_which_path_was_used(both):
  shallow, _, job = both
  saved = json.loads((job / "dry_run.json").read_text())
  assert saved["compile_path"] == "shallow" and saved["compile_path_reason"] is None
  assert saved["shallow"]["field"] == "model.num_layers" and len(saved["shallow"]["compile_seconds"]) == 2
  assert "shallow copies of 3 and 4 layers" in ex.format_path(saved)


def test_a_shallow_flash_dry_run_adds_the_full_depth_kernel_time():
  """The splash kernel is 0 FLOPs in XLA's costs: the full-compile dry run adds its time, and
  the extrapolated prediction (rebuilt from deepened costs) must too, at the full depth."""
  pytest.importorskip("libtpu")
  from shardax.sharding import make_mesh
  from shardax.perf import hardware, stepmodel
  small = [o for o in SMALL if not o.startswith(("data.seq_len", "model.max_len"))]
  exp = build("lm.tiny", *small, "data.seq_len=128", "model.max_len=128", "model.attention='flash'",
              "model.num_layers=12")
  out = ex.dry_run(exp, effort=-1.0)
  assert out["compile_path"] == "shallow"
  mesh = make_mesh(exp.mesh)
  want = stepmodel.flash_kernel_seconds(exp, int(mesh.size), hardware.lookup(mesh.devices.flat[0].device_kind))
  assert want > 0 and out["predicted"]["breakdown"]["flash_kernel_seconds"] == pytest.approx(want)
  # and its FLOPs run on the chip: counted in the hardware FLOPs (HFU, recompute factor)
  kernel_flops = stepmodel.flash_kernel_flops(exp, int(mesh.size))
  assert out["predicted"]["hardware_flops_per_device"] == pytest.approx(out["flops_per_device"] + kernel_flops)


def test_an_extrapolated_report_that_does_not_fit_ranks_no_levers_from_the_shallow_buffers():
  """The buffer list of the shallow path is the 2-layer copy's: ranked against the 12-layer
  model, its saved activations [2, batch, length, d] never matched the offload lever
  (shape[0] == num_layers) and the byte savings were the copy's. The hint gives the
  general advice and says why it ranks nothing."""
  exp = build("lm.tiny", *SMALL, "model.num_layers=12", "model.remat='none'")
  seq = exp.data.seq_len
  block = lambda shape, b: {"space": "device", "shape": shape, "dtype": "f32", "bytes": b}
  out = {"bytes_per_device": {"total": 2 * 2**30, "params": 2**20, "optimizer_state": 2**21},
         "hbm_bytes_per_device": 2**30, "device_kind": "cpu", "predicted": None, "num_devices": 4,
         "buffers": [block((2, 2, seq, 128), 2**29), block((2, seq, exp.model.vocab_size), 2**28)]}
  hint = ex._derive(out, exp)["hint"]
  assert "GiB (" not in hint and "without --shallow" in hint, hint
  assert hint.startswith("by the shallow copies' extrapolation, an estimate"), hint


def test_temp_that_falls_with_depth_makes_memory_unknown_not_zero():
  """moe.deepseek_v3 with model.remat='full': the 6- and 7-layer copies needed 25.06 and 17.12 GB
  of temp; the line through them reached 0 long before 61 layers, the clamp made it 0 bytes and
  the report said "fits: yes". Memory falling with depth says nothing about the full depth."""
  from shardax.perf import dry_run as dry_run_lib
  exp = build("lm.tiny", *SMALL, "model.num_layers=61")
  gb = 10**9
  copy = lambda temp: {"bytes_per_device": {"params": 2 * gb, "optimizer_state": 4 * gb, "temp": temp,
                                            "total": 6 * gb + temp},
                       "hbm_bytes_per_device": 100 * gb, "device_kind": "cpu", "predicted": None,
                       "num_devices": 4, "fits": True, "error": None}
  shallow = {"layers": [6, 7], "temp_bytes": [25 * gb, 17 * gb]}
  out = ex.affine(copy(25 * gb), copy(17 * gb), 6, 7, 61)
  ex._refuse_falling_temp(out, shallow)
  out = ex._derive(out, exp)
  assert out["fits"] is None and out["hint"] is None
  mem = out["bytes_per_device"]
  assert mem["temp"] is None and mem["total"] is None
  assert (mem["params"], mem["optimizer_state"]) == (2 * gb, 4 * gb)  # exactly affine: kept
  assert "without --shallow" in out["memory_unknown"]
  # within compiler noise a flat temp is a temp, and a growing one is extrapolated as before
  for temps in ([25 * gb, int(24.9 * gb)], [17 * gb, 25 * gb]):
    out = ex.affine(copy(temps[0]), copy(temps[1]), 6, 7, 61)
    ex._refuse_falling_temp(out, {"layers": [6, 7], "temp_bytes": temps})
    assert "memory_unknown" not in out and out["bytes_per_device"]["total"] > 0
  report = {**ex._derive(out, exp), "experiment": "x", "topology": "v5e:2x2", "num_params": 1,
            "global_batch": 8, "tokens_per_step": 512, "compile_seconds": 1.0, "compile_cpu_seconds": 1.0,
            "mesh": {}, "collectives": {}, "flops_per_device": None, "error": None, "fits": None,
            "memory_unknown": "temp fell with depth ...; run without --shallow to compile it"}
  text = dry_run_lib.format_report(report)
  assert "fits: unknown (see below)" in text and "memory unknown: temp fell" in text, text


def test_a_planned_layout_whose_memory_is_unknown_is_not_ranked(monkeypatch):
  from shardax.perf import plan
  report = {"bytes_per_device": {"total": None}, "fits": None, "compile_path": "shallow",
            "compile_seconds": 1.0, "predicted": {"step_seconds": 0.5}, "error": None,
            "memory_unknown": "temp fell with depth ...; run without --shallow to compile it"}
  monkeypatch.setattr(plan.extrapolate, "dry_run", lambda *a, **k: report)
  row = plan.evaluate("lm.tiny", SMALL, (), shallow=True)
  assert row["status"] == "memory unknown" and "without --shallow" in row["reason"]
  assert plan.rank([row]) == []
