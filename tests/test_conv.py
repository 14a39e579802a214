"""Convolutions under spatial partitioning: the sharded U-Net computes what one device does.

Splitting volume height (and width) over mesh axes is pure configuration: the rules map
logical `height`/`width` to mesh axes, and the compiled step gets its halo exchange
(collective-permutes) from the partitioner. Every sharded case is checked against the
unsharded model on one device (loss and every gradient). Then both new experiments
train a few steps through the real loop.
"""

import math
import os
import re

import jax
import numpy as np
import pytest

from shardax import configs
from shardax.configs.vision import ClassifierConfig
from shardax.layers.conv import MiscompiledPartitionError
from shardax.sharding import report, use_rules
from shardax.trainer.data import images, inputs
from shardax.trainer import loop
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from meshtools import coordinates, grads_fn, loss_and_grads, pairs, setup_for

EVEN = (4, 16, 16)     # (depth, height, width); 2 levels -> (1, 4, 4) at the bottom
UNEVEN = (4, 18, 8)    # height 18 over 4 devices: XLA pads 18 -> 20 and 9 -> 12 (1 level)


def unet_experiment(size, preset="dp", ici=(1,), axes=("data",), uneven=False):
  cfg = configs.get("conv.unet3d_tiny")
  configs.apply_overrides(cfg, [
      "model.channels=4", "model.groups=2", f"data.image_size={size!r}", "train.global_batch=2",
      f"model.levels={1 if size == UNEVEN else 2}",  # a smaller program for the extra case
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}",
      f"sharding.allow_uneven={uneven}"])
  return configs.build(cfg)


def reference_for(size):
  """Params, a shapes3d batch, and loss/grads on one device with no sharding."""
  setup = setup_for(unet_experiment(size), jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  it = inputs.Batches(setup.exp.data, "train", 2)
  batch = jax.device_get(next(it))
  it.close()
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  return params, batch, float(loss), grads


@pytest.fixture(scope="module")
def even_reference():
  return reference_for(EVEN)


def assert_same(loss, grads, ref, what):
  _, _, ref_loss, ref_grads = ref
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=what)
  flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat) > 20
  for g, r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6, err_msg=what)


SPATIAL = {"height": ("spatial", (2, 4), ("data", "spatial")),
           "height_x_width": ("spatial_hw", (2, 2, 2), ("data", "spatial", "spatial_w"))}


@pytest.fixture(scope="module", params=list(SPATIAL))
def spatial(request, even_reference):
  preset, ici, axes = SPATIAL[request.param]
  setup = setup_for(unet_experiment(EVEN, preset, ici, axes))
  params, batch, _, _ = even_reference
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  return request.param, float(loss), grads, compiled


def test_spatially_split_unet_equals_single_device(spatial, even_reference):
  name, loss, grads, _ = spatial
  assert_same(loss, grads, even_reference, name)


def test_halo_exchange_is_collective_permutes(spatial):
  """Each 3^3 conv exchanges border planes with its neighbours, forward and backward.

  Read from the program's structure (permute pairs and shapes), not op metadata: jax 0.11
  compiles the same permutes but names some after a neighbouring sharding constraint
  instead of the conv.
  """
  name, _, _, compiled = spatial
  _, ici, axes = SPATIAL[name]
  text = compiled.as_text()
  summary = report.collective_summary(text)
  permutes = [c for c in report.collectives(text) if c.kind == "collective-permute"]
  assert summary["collective-permute"]["count"] >= 20, (name, summary)
  where = coordinates(dict(zip(axes, ici)))
  plane_dim = {"spatial": 2, "spatial_w": 3}  # [batch, depth, height, width, channels]
  for c in permutes:
    dims = result_dims(text, c.name)
    for src, dst in pairs(c, math.prod(ici)):
      # To the next or previous shard along one split spatial axis, all else equal.
      moved = [a for a in axes if where[a][src] != where[a][dst]]
      assert len(moved) == 1 and moved[0] in plane_dim, (name, c)
      assert abs(int(where[moved[0]][dst]) - int(where[moved[0]][src])) == 1, (name, c)
      assert len(dims) == 5 and dims[plane_dim[moved[0]]] == 1, (name, c, dims)  # one plane
  # The activations themselves never travel whole: all-gathers, if any, stay small.
  assert summary.get("all-gather", {"bytes": 0})["bytes"] < summary["collective-permute"]["bytes"]


def result_dims(hlo_text, name):
  """The dims of instruction `name`'s result in compiled HLO text."""
  m = re.search(r"%" + re.escape(name) + r" = \(?\w+\[([\d,]*)\]", hlo_text)  # "(": an async start
  return [int(d) for d in m.group(1).split(",") if d]


def test_uneven_height_is_padded_by_xla_with_allow_uneven():
  ref = reference_for(UNEVEN)
  params, batch, _, _ = ref
  setup = setup_for(unet_experiment(UNEVEN, "spatial", (2, 4), ("data", "spatial"), uneven=True))
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  assert_same(float(loss), grads, ref, "uneven height")
  assert report.collective_summary(compiled.as_text())["collective-permute"]["count"] >= 20


def test_uneven_height_without_allow_uneven_is_a_clear_error():
  setup = setup_for(unet_experiment(UNEVEN, "spatial", (2, 4), ("data", "spatial")))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, False):
    with pytest.raises(ValueError, match=r"'height'.*size 18.*allow_uneven=True"):
      grads_fn(setup).lower(setup.abstract["params"], step_lib.abstract_batch(setup))


@pytest.mark.parametrize("size, preset, ici, axes, match", [
    # `spatial` leaves mesh axis spatial_w idle: XLA would double the kernel gradients.
    (EVEN, "spatial", (2, 2, 2), ("data", "spatial", "spatial_w"), r"replicated over mesh axes \['spatial_w'\]"),
    # height x width split down to one row per shard: XLA gets the input gradient wrong.
    ((4, 8, 8), "spatial_hw", (2, 2, 2), ("data", "spatial", "spatial_w"), "one row per shard"),
])
def test_splits_xla_miscompiles_are_refused(size, preset, ici, axes, match):
  setup = setup_for(unet_experiment(size, preset, ici, axes))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    with pytest.raises(MiscompiledPartitionError, match=match):
      grads_fn(setup).lower(setup.abstract["params"], step_lib.abstract_batch(setup))


def test_documented_flops_match_the_compiler():
  """2 x conv MACs of the classifier's forward vs XLA's count of the compiled forward.

  XLA skips the taps that fall on SAME padding and we count every tap (the usual
  convention for MFU), so ours is a little higher: ~9% at 32x32 (down to 8x8).
  """
  cfg = configs.get("conv.digits")
  configs.apply_overrides(cfg, ["data.image_size=(32, 32)"])
  exp = configs.build(cfg)
  setup = setup_for(exp, jax.devices()[:1])
  fwd = jax.jit(lambda p, x: setup.model(p)(x))
  x = jax.ShapeDtypeStruct((1, 32, 32, 1), np.float32)
  xla = report.flops(fwd.lower(setup.abstract["params"], x).compile())
  ours = exp.model.flops_per_example(exp.data) / 3
  assert ours == 2 * exp.model.forward_macs(exp.data)
  assert xla <= ours <= 1.15 * xla, (ours, xla)


def test_shapes3d_is_deterministic_and_resumes():
  exp = unet_experiment((8, 8, 8))
  a, b = images.source(exp.data, "train"), images.source(exp.data, "train")
  np.testing.assert_array_equal(a[5]["images"], b[5]["images"])
  val = images.source(exp.data, "validation")
  assert not np.array_equal(a[5]["labels"], val[5]["labels"])
  assert set(np.unique(np.concatenate([a[i]["labels"].ravel() for i in range(8)]))) == {0, 1, 2}
  it = inputs.Batches(exp.data, "train", 4)
  next(it)
  state = it.get_state()
  expected = next(it)
  again = inputs.Batches(exp.data, "train", 4)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["images"], expected["images"])
  it.close(), again.close()


def test_digits_splits_are_disjoint_and_scaled():
  cfg = configs.build(configs.get("conv.digits")).data
  train, val = images.source(cfg, "train"), images.source(cfg, "validation")
  assert len(train) + len(val) == 1797 and len(val) == round(1797 * cfg.validation_fraction)
  ex = train[0]
  assert ex["images"].shape == (16, 16, 1) and 0 <= ex["images"].min() <= ex["images"].max() <= 1
  assert isinstance(configs.build(configs.get("conv.digits")).model, ClassifierConfig)


@pytest.mark.parametrize("name, overrides", [
    ("conv.unet3d_spatial", ["model.channels=4", "model.groups=2", "model.levels=1",
                             "data.image_size=(4, 8, 8)", "train.global_batch=2",
                             "mesh.num_cpu_devices=8"]),
    ("conv.digits", ["model.channels=8", "train.global_batch=32"]),
])
def test_experiment_trains_and_checkpoints(name, overrides, tmp_path):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, overrides + [
      "train.steps=6", "train.log_every=1", "train.eval_every=6", "train.eval_batches=2",
      "optimizer.warmup_steps=1", "optimizer.learning_rate=5e-3", "checkpoint.every=6",
      "checkpoint.async_save=False"])
  exp = configs.build(cfg)
  summary = loop.train(exp, str(tmp_path))
  assert summary["final_step"] == 6 and not summary["skipped_steps"]
  assert summary["eval_losses"][6] < summary["eval_losses"][0]   # the same validation batches
  losses = summary["losses"]
  assert losses[5] + losses[6] < losses[1] + losses[2], losses
  assert "6" in os.listdir(tmp_path / "checkpoints")
