"""Train state, born sharded.

The model is first built abstractly (`nnx.eval_shape`: shapes and the
`logical_axes` each param carries, no memory). From those names and the
experiment's rules come the shardings of params and optimizer state; a jitted
init with those out_shardings then creates every array directly on its devices,
so no process ever holds the full model.

The state is a plain pytree: {"step": int32[], "params": {...}, "opt_state": optax state}.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax import layers  # noqa: F401  (registers the model classes the configs make)
from shardax.configs.schema import Experiment
from shardax.sharding import params as params_lib
from shardax.sharding import rules as rules_lib
from shardax.trainer import optimizer


def build_model(cfg: Any, rngs: nnx.Rngs) -> nnx.Module:
  """Any model config with `make(rngs)`, `batch_fields(data)`; the model has `loss_and_metrics`."""
  return cfg.make(rngs)


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything derived once from an experiment and a mesh."""
  exp: Experiment
  mesh: Mesh
  rules: rules_lib.Rules
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  abstract: Any          # state tree of ShapeDtypeStruct, each with its sharding
  shardings: Any         # state tree of NamedSharding
  param_axes: Any        # params tree of logical-axes tuples
  batch_sharding: dict[str, NamedSharding]   # per batch field

  def model(self, params) -> nnx.Module:
    """The model with `params` plugged in (inside jit: a traced, stateless view)."""
    return nnx.merge(self.graphdef, params)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())


def _abstract_params(cfg: Any):
  model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise TypeError(f"model holds non-parameter state {rest}; the trainer only carries nnx.Param")
  return graphdef, nnx.to_pure_dict(params), params_lib.logical_axes_of(params)


def create(exp: Experiment, mesh: Mesh) -> Setup:
  """Everything about the state but its values. Works for any mesh, also one over TPU
  devices that exist only on paper (dry runs): it runs under the mesh's abstract view,
  so the few tiny eager ops optax makes while building its state tree stay on the host."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return _create(exp, mesh)


def _create(exp: Experiment, mesh: Mesh) -> Setup:
  rules = rules_lib.resolve(exp.sharding.preset, exp.sharding.rules)
  graphdef, params_abs, axes = _abstract_params(exp.model)
  param_sh = params_lib.param_shardings(params_abs, axes, rules, mesh, exp.sharding.allow_uneven)
  tx = optimizer.make(exp.optimizer, exp.train.steps, params_abs, axes)
  opt_abs = jax.eval_shape(tx.init, params_abs)
  replicated = NamedSharding(mesh, PartitionSpec())
  opt_sh = _opt_state_shardings(exp, opt_abs, params_abs, axes, rules, mesh)
  shardings = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
  abstract_tree = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params_abs, "opt_state": opt_abs}
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_tree, shardings)
  return Setup(exp, mesh, rules, graphdef, tx, abstract, shardings, axes,
               _batch_shardings(exp, rules, mesh))


def _opt_state_shardings(exp: Experiment, opt_abs, params_abs, axes, rules, mesh: Mesh):
  """Optimizer state split along the logical axes of the param dims it keeps: moments
  and master copies exactly like their params, factored moments like the kept dims."""
  mesh_shape = dict(mesh.shape)

  def sharding(names, leaf):
    spec = rules_lib.logical_to_spec(names, rules, mesh_shape, leaf.shape, name="optimizer state",
                                     allow_uneven=exp.sharding.allow_uneven)
    return NamedSharding(mesh, spec)

  return optimizer.map_state_axes(opt_abs, params_abs, axes, sharding)


def _batch_shardings(exp: Experiment, rules, mesh: Mesh) -> dict[str, NamedSharding]:
  out = {}
  for key, (shape, _, logical) in exp.model.batch_fields(exp.data).items():
    spec = rules_lib.logical_to_spec(logical, rules, dict(mesh.shape))
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
    degree = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    per_micro = exp.train.global_batch // exp.train.microbatches
    if per_micro % degree:
      raise ValueError(
          f"train.global_batch={exp.train.global_batch} (over train.microbatches="
          f"{exp.train.microbatches}) is not divisible by the data-parallel degree {degree} "
          f"(batch split over mesh axes {axes} of mesh {dict(mesh.shape)}); use a multiple of {degree}")
    # jit arguments must split evenly (only intermediates may be padded), so no allow_uneven.
    rules_lib.logical_to_spec(logical, rules, dict(mesh.shape), (per_micro,) + tuple(shape),
                              name=f"batch field {key!r}")
    out[key] = NamedSharding(mesh, spec)
  return out


def init_fn(setup: Setup) -> Callable[[jax.Array], Any]:
  """A jitted `key -> state` whose outputs are created already sharded."""
  cfg, tx = setup.exp.model, setup.tx

  def init(key):
    model = build_model(cfg, nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

  return jax.jit(init, out_shardings=setup.shardings)


def count_params(setup: Setup) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(setup.abstract["params"]))
