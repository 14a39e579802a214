"""Published runs rebuilt as experiments: every real slice shape, MoE and Pax layouts, and
rows that cannot be rebuilt failing with a message (experiments/calibration.py).

The published-runs table lives beside the checkout, in `../shared/published-runs/` (CI
clones the repository next to `shared/`). A test that needs it fails when it is missing;
set SHARDAX_SKIP_PUBLISHED_RUNS=1 to skip those tests instead (a checkout without it)."""

import copy
import dataclasses
import json
import os
import sys

import pytest

from shardax import configs
from shardax.experiments import calibration
from shardax.sharding import topology
from shardax.perf import hardware

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(os.path.dirname(ROOT), "shared", "published-runs", "calibration.json")
SKIP_ENV = "SHARDAX_SKIP_PUBLISHED_RUNS"

# Cloud TPU slice shapes: chips -> shape (v6e-32 is 4x8, v6e-128 is 8x16; v4-384 is 4x4x12).
SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 192: "4x4x12",
             256: "4x8x8", 512: "8x8x8", 2048: "8x16x16"}


@needs_libtpu
@pytest.mark.parametrize("gen, shapes", [("v5e", SHAPES_2D), ("v6e", SHAPES_2D), ("v4", SHAPES_3D),
                                         ("v5p", SHAPES_3D), ("tpu7x", SHAPES_3D)])
def test_every_slice_shape_is_one_libtpu_knows(gen, shapes):
  for chips, shape in shapes.items():
    name = calibration.slice_shape(gen, chips)
    assert name == f"{gen}:{shape}"
    devices = topology.devices(name)   # libtpu's get_topology_desc accepts it
    assert len(devices) == chips * hardware.lookup(devices[0].device_kind).devices_per_chip


def test_slice_counts_that_do_not_exist_are_named():
  with pytest.raises(ValueError, match="power-of-two chip count"):
    calibration.slice_shape("v6e", 24)
  with pytest.raises(ValueError, match="multiple of 64"):
    calibration.slice_shape("v5p", 96)


def published_runs(path: str = RUNS) -> list[dict]:
  """The published-runs table; a missing one fails the test (skips it with SKIP_ENV=1)."""
  if not os.path.exists(path):
    if os.environ.get(SKIP_ENV) == "1":
      pytest.skip(f"no published-runs table at {path} ({SKIP_ENV}=1)")
    pytest.fail(f"no published-runs table at {path}: clone the repository beside shared/ "
                f"(../shared/published-runs/calibration.json), or set {SKIP_ENV}=1 to skip")
  return json.load(open(path))


def _row(rid="maxtext-v4-22B-1xv4-128"):
  return copy.deepcopy(next(r for r in published_runs() if r["id"] == rid))


def _mixtral_on_v6e(r):
  r["id"] = "mixtral-8x7b-v6e-256"
  r["hardware"].update(accelerator="TPU v6e", chips_per_slice=256, num_slices=1, total_chips=256)
  r["model"].update(arch_type="moe", num_experts=8, experts_per_token=2, num_layers=32, d_model=4096,
                    num_heads=32, num_kv_heads=8, head_dim=128, d_ff=14336, gated_mlp=True, activation="silu",
                    vocab_size=32000, tied_embeddings=False, block="sequential")
  r["training"]["capacity_factor"] = 1.25
  r["sharding"] = {"ici": {"data": 1, "fsdp": 32, "tensor": 1, "expert": 8}, "dcn": None}
  return r


def test_a_mixtral_shaped_moe_row_maps_onto_the_moe_config_and_an_expert_axis():
  exp = configs.build(calibration.from_row(_mixtral_on_v6e(_row()), num_layers=4))
  assert exp.mesh.topology == "v6e:16x16"
  assert exp.mesh.axes == ("data", "fsdp", "model", "expert") and exp.mesh.ici == (1, 32, 1, 8)
  assert ("expert", "expert") in exp.sharding.rules
  m = exp.model.moe
  assert (m.num_experts, m.d_ff, m.every, m.capacity_factor) == (8, 14336, 1, 1.25)
  assert exp.model.num_kv_heads == 8 and exp.model.num_layers == 4


def test_a_capacity_row_is_top2_capacity_dispatch_with_its_factor():
  m = configs.build(calibration.from_row(_mixtral_on_v6e(_row()), num_layers=4)).model.moe
  assert (m.dispatch, m.top_k, m.capacity_factor, m.second_expert) == ("capacity", 2, 1.25, "all")


@pytest.mark.parametrize("impl", ["dropless (megablox)", "ragged_dot", "MaxText sparse_matmul"])
def test_dropless_rows_and_any_top_k_map_onto_dispatch_and_top_k(impl):
  r = _mixtral_on_v6e(_row())
  r["training"]["moe_impl"] = impl
  r["model"].update(experts_per_token=8, num_experts=64, num_shared_experts=1)
  exp = configs.build(calibration.from_row(r, num_layers=4))
  m = exp.model.moe
  assert (m.dispatch, m.top_k, m.num_experts, m.num_shared_experts) == ("dropless", 8, 64, 1)
  # MaxText's capacity_factor=-1 is dropless too, whatever the row calls its kernel
  r = _mixtral_on_v6e(_row())
  r["training"]["capacity_factor"] = -1
  r["model"]["experts_per_token"] = 4
  m = configs.build(calibration.from_row(r, num_layers=4)).model.moe
  assert (m.dispatch, m.top_k) == ("dropless", 4)


def test_a_top_k_row_without_an_implementation_is_dropless_and_says_so():
  r = _mixtral_on_v6e(_row())
  del r["training"]["capacity_factor"]
  r["model"]["experts_per_token"] = 6
  m = configs.build(calibration.from_row(r, num_layers=4)).model.moe
  assert (m.dispatch, m.top_k) == ("dropless", 6)
  assert "dropless dispatch (the row names no MoE implementation)" in calibration.approximations(r)


def test_what_cannot_be_rebuilt_is_named_not_a_traceback():
  r = _mixtral_on_v6e(_row())
  r["model"]["experts_per_token"] = 4   # with capacity_factor 1.25: GShard capacity is top-2 only
  with pytest.raises(calibration.Unexpressible, match="experts_per_token=4.*capacity dispatch is GShard's top-2"):
    calibration.from_row(r)
  r = _mixtral_on_v6e(_row())
  r["training"]["moe_impl"] = "expert_choice"
  del r["training"]["capacity_factor"]
  with pytest.raises(calibration.Unexpressible, match="training.moe_impl='expert_choice' is neither"):
    calibration.from_row(r)
  r = _row()
  r["training"]["attention_kernel"] = "cudnn_flash_te"
  with pytest.raises(calibration.Unexpressible, match="attention_kernel='cudnn_flash_te' is a GPU kernel"):
    calibration.from_row(r)
  r = _row()
  del r["model"]["d_model"]
  with pytest.raises(calibration.Unexpressible, match="no field 'd_model'"):
    calibration.from_row(r)
  r = _row()
  r["sharding"]["ici"] = {"data": 16, "sequence": 4}
  with pytest.raises(calibration.Unexpressible, match=r"mesh axes \['sequence'\] have no shardax counterpart"):
    calibration.from_row(r)


@pytest.mark.parametrize("kernel, gpu, want", [
    ("Pallas TPU flash_attention, causal=True", False, "flash"),
    ("splash attention (Pallas)", False, "flash"),
    ("plain XLA dot-product attention with causal mask (no flash kernel in MaxText at that date)", False, "xla"),
    ("XLA dot-product attention; attention_logits_dtype float32", False, "xla"),
    ("some new kernel", False, "xla"),
    ("cudnn_flash_te (TransformerEngine cuDNN fused attention, NVTE_FUSED_ATTN=1)", True, "flash"),
    ("dot_product", True, "xla")])
def test_the_attention_kernel_maps_onto_model_attention(kernel, gpu, want):
  r = _row("maxtext-a3-llama2-7b-1vm" if gpu else "maxtext-v4-22B-1xv4-128")
  r["training"]["attention_kernel"] = kernel
  exp = configs.build(calibration.from_row(r, num_layers=2))
  assert exp.model.attention == want
  notes = calibration.approximations(r)
  assert ("XLA attention for some new kernel" in notes) == (kernel == "some new kernel")
  assert any("splash kernel for cuDNN flash" in n for n in notes) == (gpu and want == "flash")


def test_flash_rows_whose_length_the_splash_kernel_cannot_take_stay_xla_and_say_so():
  r = _row("maxtext-v5p-32B-1xv5p-128")
  r["training"]["seq_len"] = 1000
  assert configs.build(calibration.from_row(r, num_layers=2)).model.attention == "xla"
  assert "XLA attention for flash (seq_len not a multiple of 128)" in calibration.approximations(r)


@pytest.mark.parametrize("policy, want", [
    ("qkv_proj_offloaded", "offload_proj"), ("minimal_offloaded", "offload_proj"),
    ("decoder_layer_input_offloaded", "offload"), ("custom_offload_everything", "offload"),
    ("minimal (jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)", "dots_no_batch"),
    ("full (nn.remat)", "full"), ("something_new", "full")])
def test_remat_policies_map_offloading_onto_the_offload_policies(policy, want):
  r = _row()
  r["training"]["remat_policy"] = policy
  assert configs.build(calibration.from_row(r, num_layers=2)).model.remat == want


def test_the_pax_replica_data_mdl_mesh_is_data_fsdp_model():
  r = _row()
  r["sharding"] = {"ici": {"mesh_shape": [1, 16, 4], "mesh_axis_names": ["replica", "data", "mdl"]},
                   "dcn": {"mesh_shape": [2, 1, 1]}}
  r["hardware"]["num_slices"] = 2
  exp = configs.build(calibration.from_row(r))
  assert exp.mesh.axes == ("data", "fsdp", "model")
  assert exp.mesh.ici == (1, 16, 4) and exp.mesh.dcn == (2, 1, 1)
  assert exp.sharding.preset == "dp_fsdp_tp"


def _calibrate():
  import importlib.util
  path = os.path.join(ROOT, "benchmarks", "calibrate.py")
  spec = importlib.util.spec_from_file_location("calibrate", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_a_cache_compiled_before_the_kernel_mapping_is_named_in_the_table():
  cal = _calibrate()
  flash_row, xla_row = _row("maxtext-v5p-32B-1xv5p-128"), _row()
  old = {"id": flash_row["id"], "layers": 3}   # caches before the mapping carry no attention/remat
  assert cal.compiled_as(flash_row, old) == ["cached compile: xla attention, predates the flash mapping"]
  assert cal.compiled_as(flash_row, dict(old, attention="flash", remat="dots_no_batch")) == []
  assert cal.compiled_as(xla_row, {"id": xla_row["id"]}) == []
  assert cal.compiled_as(xla_row, {"attention": "xla", "remat": "offload"}) == [
      "cached compile: remat offload, predates the full mapping"]


def test_a_cache_read_before_the_newer_readings_is_named_so_compile_replaces_it():
  """`--compile` recompiles what `compiled_as` names: a cache without the entry's stacked share, or
  a GPU stand-in's without the traffic of its matmul-free kernels, priced as an older reader did."""
  cal = _calibrate()
  gpu_row, tpu_row = _row("maxtext-a3-llama2-7b-2vm"), _row()
  piece = {"computation": "main", "onchip_bytes": 0.0, "stacked": [], "matmul_free_bytes": 0.0}
  entry = lambda row, **drop: {"id": row["id"], "attention": cal._build(row, None).model.attention,
                               "remat": cal._build(row, None).model.remat,
                               "libtpu_flags": [] if "flags" in drop else list(calibration.libtpu_flags(row)),
                               "costs": {"pieces": [{k: v for k, v in piece.items() if k not in drop}]}}
  assert cal.compiled_as(gpu_row, entry(gpu_row)) == [] and cal.compiled_as(tpu_row, entry(tpu_row)) == []
  assert cal.compiled_as(tpu_row, entry(tpu_row, stacked=1)) == [
      "cached compile: the entry's traffic deepened whole, predates its stacked share"]
  assert cal.compiled_as(gpu_row, entry(gpu_row, matmul_free_bytes=1)) == [
      "cached compile: kernels without matmuls priced under the matmuls, predates perf/kernels.py"]
  assert cal.compiled_as(tpu_row, entry(tpu_row, matmul_free_bytes=1)) == []   # a TPU prices them as before
  # a stand-in compiled with the TPU compiler's windowed einsums, which a GPU program does not run
  assert cal.compiled_as(gpu_row, entry(gpu_row, flags=1)) == [
      "cached compile: libtpu flags other than the row's (--xla_tpu_enable_windowed_einsum_for_all_gather=false "
      "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false), predates them"]
  assert cal.compiled_as(tpu_row, entry(tpu_row, flags=1)) == []   # a TPU row without published flags


@needs_libtpu
def test_a_flash_compiled_cache_adds_the_kernel_time_its_costs_miss():
  cal = _calibrate()
  row = _row("maxtext-v5p-32B-1xv5p-128")
  path = os.path.join(cal.CACHE, f"{row['id']}.json")
  if not os.path.exists(path):
    pytest.skip("no cached costs for the row")
  entry = json.load(open(path))
  xla = cal.predict_row(row, dict(entry, attention="xla"))
  flash = cal.predict_row(row, dict(entry, attention="flash"))
  kernel = flash.breakdown["flash_kernel_seconds"]
  assert kernel > 0 and flash.step_seconds == pytest.approx(xla.step_seconds + kernel)
  assert flash.mfu == pytest.approx(xla.mfu * xla.step_seconds / flash.step_seconds)


def test_a_gpu_row_is_timed_on_its_gpu_and_its_cluster_network():
  r = _row("maxtext-a3-llama2-7b-2vm")
  assert calibration.gpu_kind(r) == "NVIDIA H100 80GB HBM3"
  assert configs.build(calibration.from_row(r, num_layers=2)).mesh.network == "a3-high"
  r["hardware"]["accelerator"] = "NVIDIA H100 80GB (A3 Mega)"
  assert configs.build(calibration.from_row(r, num_layers=2)).mesh.network == "a3-mega"
  r["hardware"].update(accelerator="NVIDIA H200", slice_name_as_published="2x h200-8", naming_convention="")
  assert calibration.gpu_kind(r) == "NVIDIA H200"
  assert "network not named: A3 High's" in calibration.approximations(r)
  r["hardware"]["accelerator"] = "NVIDIA GB300"
  with pytest.raises(ValueError, match="'NVIDIA GB300' is not in the chip table"):
    calibration.from_row(r, num_layers=2)


@pytest.mark.slow   # the TPU compiler takes ~50 s on this tiny MoE step (the capacity dispatch; dropless ~120 s)
@needs_libtpu
def test_a_moe_row_compiles_and_is_predicted_through_the_calibration_path(tmp_path, monkeypatch):
  """A Mixtral-shaped row cut to a tiny width: `compile_row` read `exp.model.d_model` of an
  MoE config that kept it under `model.transformer` and crashed (AttributeError) before the
  one-config change; now it compiles for a v6e-4 slice with the experts over all 4 chips and
  `predict_row` prices the step, its expert all-to-alls included, with the program summary and
  the MXU read cached beside the costs."""
  cal = _calibrate()
  monkeypatch.setattr(cal, "CACHE", str(tmp_path))
  row = _mixtral_on_v6e(_row())
  row["hardware"].update(chips_per_slice=4, total_chips=4)
  row["sharding"] = {"ici": {"data": 1, "fsdp": 1, "tensor": 1, "expert": 4}, "dcn": None}
  row["model"].update(d_model=256, num_heads=4, num_kv_heads=2, head_dim=64, d_ff=256, vocab_size=1024)
  row["training"].update(global_batch_seqs=8, seq_len=256)
  entry = cal.compile_row(row, 1)
  assert entry["topology"] == "v6e:2x2" and os.path.exists(tmp_path / f"{row['id']}.json")
  assert "all-to-all" in entry["program"]["collectives"] and entry["mxu"]
  predicted = cal.predict_row(row, entry)
  assert predicted.step_seconds > 0 and predicted.breakdown["compute_seconds"] > 0
  assert predicted.breakdown["collectives"]["by_kind"]["all-to-all"] > 0


def test_a_missing_published_runs_table_fails_unless_skipped_on_purpose(tmp_path, monkeypatch):
  """Without ../shared the table's tests fail (a silent skip hid them on every machine but one)."""
  outcomes = (pytest.fail.Exception, pytest.skip.Exception)   # caught, else a skip would skip this test
  monkeypatch.delenv(SKIP_ENV, raising=False)
  with pytest.raises(outcomes) as missing:
    published_runs(str(tmp_path / "none.json"))
  assert missing.type is pytest.fail.Exception and "clone the repository beside shared/" in str(missing.value)
  monkeypatch.setenv(SKIP_ENV, "1")
  with pytest.raises(outcomes) as skipped:
    published_runs(str(tmp_path / "none.json"))
  assert skipped.type is pytest.skip.Exception and SKIP_ENV in str(skipped.value)
  assert RUNS.startswith(os.path.dirname(ROOT) + os.sep)   # beside the checkout, wherever it is


@needs_libtpu
def test_a_row_priced_under_its_roofline_is_recorded_as_refused_not_a_crash(tmp_path, monkeypatch, capsys):
  """A row whose cached costs miss most of the work (every piece's FLOPs and bytes a hundredth)
  prices under the model FLOPs at peak: predict_row refuses it, and the table records the row
  as refused, outside the error factors, instead of the calibration crashing."""
  from shardax.perf import costs, stepmodel
  cal = _calibrate()
  row = _row()
  path = os.path.join(cal.CACHE, f"{row['id']}.json")
  if not os.path.exists(path):
    pytest.skip("no cached costs for the row")
  entry = json.load(open(path))
  assert cal.predict_row(row, entry).step_seconds > 0   # as cached: priced
  c = costs.from_json(entry["costs"])
  short = dataclasses.replace(c, pieces=tuple(
      dataclasses.replace(p, flops=p.flops / 100, bytes_accessed=p.bytes_accessed / 100) for p in c.pieces))
  entry = dict(entry, costs=costs.to_json(short))
  with pytest.raises(stepmodel.ImpossiblePrediction, match="model FLOPs time at peak"):
    cal.predict_row(row, entry)
  (tmp_path / f"{row['id']}.json").write_text(json.dumps(entry))
  (tmp_path / "runs.json").write_text(json.dumps([row]))
  monkeypatch.setattr(cal, "CACHE", str(tmp_path))
  monkeypatch.setattr(sys, "argv", ["calibrate.py", "--runs", str(tmp_path / "runs.json"), "--rows", row["id"]])
  cal.main()
  line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(f"| {row['id']} |"))
  assert "refused:" in line and "under the roofline" in line, line


def _rounded(v):
  """`v` with every float to 9 significant digits (a summary read back from JSON, compared)."""
  if isinstance(v, dict):
    return {k: _rounded(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_rounded(x) for x in v]
  return float(f"{v:.9g}") if isinstance(v, float) else v


@needs_libtpu
def test_the_dry_runs_error_bar_file_is_what_the_cached_rows_give_today():
  """perf/calibration_errors.json (what every dry run prints under its prediction) recomputed
  from the cached costs of every published row through the step model as it is now: a change
  to the model that moves a row's error without rerunning benchmarks/calibrate.py fails here."""
  from shardax.perf import error_bar
  cal = _calibrate()
  rows = published_runs()
  results, _, _ = cal.evaluate(rows)
  errors = cal.errors_of(rows, results)
  assert len(errors) == len(rows), sorted(set(r["id"] for r in rows) - set(errors))
  stored = json.load(open(error_bar.ERRORS))
  assert _rounded(stored) == _rounded(error_bar.summary(errors)), (
      "perf/calibration_errors.json is stale: run benchmarks/calibrate.py over the whole table")
