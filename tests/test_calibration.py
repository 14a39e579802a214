"""Published runs rebuilt as experiments: every real slice shape, MoE and Pax layouts, and
rows that cannot be rebuilt failing with a message (experiments/calibration.py)."""

import copy
import json
import os

import pytest

from shardax import configs
from shardax.experiments import calibration
from shardax.sharding import topology

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")
RUNS = "/work/shared/published-runs/calibration.json"

# Cloud TPU slice shapes: chips -> shape (v6e-32 is 4x8, v6e-128 is 8x16; v4-384 is 4x4x12).
SHAPES_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 192: "4x4x12",
             256: "4x8x8", 512: "8x8x8", 2048: "8x16x16"}


@needs_libtpu
@pytest.mark.parametrize("gen, shapes", [("v5e", SHAPES_2D), ("v6e", SHAPES_2D), ("v4", SHAPES_3D),
                                         ("v5p", SHAPES_3D)])
def test_every_slice_shape_is_one_libtpu_knows(gen, shapes):
  for chips, shape in shapes.items():
    name = calibration.slice_shape(gen, chips)
    assert name == f"{gen}:{shape}"
    assert len(topology.devices(name)) == chips   # libtpu's get_topology_desc accepts it


def test_slice_counts_that_do_not_exist_are_named():
  with pytest.raises(ValueError, match="power-of-two chip count"):
    calibration.slice_shape("v6e", 24)
  with pytest.raises(ValueError, match="multiple of 64"):
    calibration.slice_shape("v5p", 96)


def _row(rid="maxtext-v4-22B-1xv4-128"):
  if not os.path.exists(RUNS):
    pytest.skip("no published-runs table on this machine")
  return copy.deepcopy(next(r for r in json.load(open(RUNS)) if r["id"] == rid))


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
  assert exp.model.transformer.num_kv_heads == 8 and exp.model.transformer.num_layers == 4


def test_what_cannot_be_rebuilt_is_named_not_a_traceback():
  r = _mixtral_on_v6e(_row())
  r["training"]["moe_impl"] = "dropless (megablox)"
  fields = calibration._moe_fields()
  if not {"impl", "moe_impl", "dispatch"} & set(fields):
    with pytest.raises(calibration.Unexpressible, match="moe_impl='dropless.*no impl/dispatch field"):
      calibration.from_row(r)
  r = _row()
  del r["model"]["d_model"]
  with pytest.raises(calibration.Unexpressible, match="no field 'd_model'"):
    calibration.from_row(r)
  r = _row()
  r["sharding"]["ici"] = {"data": 16, "sequence": 4}
  with pytest.raises(calibration.Unexpressible, match=r"mesh axes \['sequence'\] have no shardax counterpart"):
    calibration.from_row(r)


def test_the_pax_replica_data_mdl_mesh_is_data_fsdp_model():
  r = _row()
  r["sharding"] = {"ici": {"mesh_shape": [1, 16, 4], "mesh_axis_names": ["replica", "data", "mdl"]},
                   "dcn": {"mesh_shape": [2, 1, 1]}}
  r["hardware"]["num_slices"] = 2
  exp = configs.build(calibration.from_row(r))
  assert exp.mesh.axes == ("data", "fsdp", "model")
  assert exp.mesh.ici == (1, 16, 4) and exp.mesh.dcn == (2, 1, 1)
  assert exp.sharding.preset == "dp_fsdp_tp"
