"""Shared by the equivalence tests: build a setup on a mesh, compile and run loss + grads."""

import jax
import numpy as np

from shardax import configs
from shardax.perf.hlo import groups as replica_groups
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib


def setup_for(exp, devices=None) -> state_lib.Setup:
  mesh = make_mesh(exp.mesh, devices)
  return state_lib.create(exp, mesh)


def packed_batch(rng, batch: int, seq: int) -> dict:
  """Three documents per row (lengths vary by row, positions restart per document), the
  last row ending in padding (loss mask 0)."""
  tokens = rng.integers(1, 256, size=(batch, seq + 1)).astype(np.int32)
  seg = np.zeros((batch, seq), np.int32)
  pos = np.zeros((batch, seq), np.int32)
  for r in range(batch):
    cuts = sorted(rng.choice(np.arange(3, seq - 3), size=2, replace=False))
    bounds = [0, *cuts, seq - (5 if r == batch - 1 else 0)]
    for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
      seg[r, a:b] = d + 1
      pos[r, a:b] = np.arange(b - a)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
          "positions": pos, "loss_mask": (seg > 0).astype(np.float32)}


def grads_fn(setup):
  """jit of `(params, batch) -> (loss, grads, model metrics)` with the setup's shardings."""
  return jax.jit(lambda p, b: step_lib.grads_and_loss(setup, p, b),
                 in_shardings=(setup.shardings["params"], setup.batch_sharding),
                 out_shardings=(setup.replicated, setup.shardings["params"], setup.replicated))


def loss_and_grads(setup, params, batch):
  """((loss, grads, metrics) on host, compiled program): compiled once, under the setup's
  mesh and rules, with `params` and `batch` placed as the setup says."""
  params = jax.device_put(params, setup.shardings["params"])
  batch = jax.device_put(batch, setup.batch_sharding)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, setup.exp.sharding.allow_uneven):
    compiled = grads_fn(setup).lower(params, batch).compile()
    return jax.device_get(compiled(params, batch)), compiled


def coordinates(mesh_shape: dict[str, int]) -> dict[str, np.ndarray]:
  """{mesh axis: that axis's coordinate of each partition id}.

  Compiled HLO names devices by partition id, the position in the mesh's flat device
  order, so these say where the members of a replica group or permute pair sit.
  """
  index = np.indices(tuple(mesh_shape.values())).reshape(len(mesh_shape), -1)
  return dict(zip(mesh_shape, index))


def pairs(collective, num_devices: int) -> list[tuple[int, int]]:
  """(source, target) partition ids of a report.Collective that is a collective-permute."""
  return [tuple(p) for p in replica_groups.groups(collective.replica_groups, num_devices)]


def tiny_lm(layers: int, batch: int, stages=1, micro=1, repeats=1, ici=(1, 1), axes=("data", "model"),
            preset="dp", extra=()):
  """A tiny lm.tiny (d_model 32, 16 positions, synthetic data) with the pipeline schedule,
  mesh and preset given; `extra`: more overrides."""
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      f"model.num_layers={layers}", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
      "model.max_len=16", "data.seq_len=16", f"train.global_batch={batch}", "data.source='synthetic'",
      f"model.pipeline.stages={stages}", f"model.pipeline.microbatches={micro}",
      f"model.pipeline.circular_repeats={repeats}",
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}", *extra])
  return configs.build(cfg)


def equations(jaxpr):
  """Every equation of `jaxpr`, nested jaxprs (scan, shard_map, remat, jit) included."""
  import jax.extend
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)
