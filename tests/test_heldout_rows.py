"""The published runs kept aside from the calibration (benchmarks/heldout_runs.json) rebuild as
their published configs, through the calibration path (experiments/calibration.py,
benchmarks/calibrate.py): MaxText's per-tensor remat policy, and the run's libtpu flags."""

import copy
import importlib.util
import json
import os

import pytest

from shardax import configs
from shardax.experiments import calibration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELDOUT = os.path.join(ROOT, "benchmarks", "heldout_runs.json")


def _calibrate():
  spec = importlib.util.spec_from_file_location("calibrate", os.path.join(ROOT, "benchmarks", "calibrate.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _rows() -> dict:
  return {r["id"]: r for r in json.load(open(HELDOUT))}


@pytest.mark.parametrize("offloaded, want", [
    (["decoder_layer_input", "query_proj", "key_proj", "value_proj"], "offload_qkv"),
    (["decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj"], "offload_proj"),
    (["decoder_layer_input"], "offload"), ([], "full")])
def test_maxtexts_custom_remat_maps_by_the_tensors_it_offloads(offloaded, want):
  r = copy.deepcopy(_rows()["tpu-recipes-llama3.1-70b-8k-v6e-128"])
  r["training"]["remat_offloaded"] = offloaded
  assert configs.build(calibration.from_row(r, num_layers=2)).model.remat == want


def test_the_kept_aside_rows_rebuild_as_published():
  cal = _calibrate()
  v5e, v6e = (_rows()[k] for k in ("maxtext-v5e-128B-1xv5e-256", "tpu-recipes-llama3.1-70b-8k-v6e-128"))
  a = cal._build(v5e, None)
  assert (a.mesh.topology, a.mesh.ici, a.model.remat, a.model.attention, a.train.global_batch) == \
      ("v5e:16x16", (1, 16, 16), "full", "flash", 256)
  assert cal._published(v5e) == pytest.approx(1640204649627648 / 110e12, rel=1e-3)   # 110 TFLOP/s a chip
  b = cal._build(v6e, None)
  assert (b.mesh.topology, b.mesh.ici, b.model.remat, b.model.attention, b.train.global_batch, b.data.seq_len) == \
      ("v6e:8x16", (1, 128, 1), "offload_qkv", "flash", 512, 8192)
  assert cal._published(v6e) == 34.786
  assert not any(a.startswith("remat") for a in calibration.approximations(v6e))   # the custom policy's own set


def test_a_rows_libtpu_flags_are_set_before_libtpu_loads_and_a_second_set_is_refused(monkeypatch):
  cal = _calibrate()
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_user_flag=1")
  v5e, v6e = (_rows()[k] for k in ("maxtext-v5e-128B-1xv5e-256", "tpu-recipes-llama3.1-70b-8k-v6e-128"))
  assert cal._apply_libtpu_flags(v5e) == tuple(v5e["training"]["libtpu_flags"])
  args = os.environ["LIBTPU_INIT_ARGS"].split()
  assert args[0] == "--xla_user_flag=1" and "--xla_tpu_enable_async_collective_fusion=true" in args
  cal._apply_libtpu_flags(v5e)   # the same flags again: nothing to refuse
  with pytest.raises(ValueError, match="compile the row in its own process"):
    cal._apply_libtpu_flags(v6e)
