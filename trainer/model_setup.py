"""The model on a mesh, without the optimizer: what eval, decode, export and import need.

The model is built abstractly (`nnx.eval_shape`: shapes and the `logical_axes` each param
carries, no memory); from those names and the experiment's rules come the params' and the
batch's shardings. Nothing here knows of an optimizer: the training setup
(trainer/state.py) adds one on top of a `ModelSetup`, and only training builds it.
Params are restored onto a `ModelSetup` by `checkpoint.restore_params`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax import models
from shardax.configs.schema import Experiment
from shardax.sharding import params as params_lib
from shardax.sharding import rules as rules_lib


def build_model(cfg: Any, rngs: nnx.Rngs) -> nnx.Module:
  """The module of a model config, through its family's spec (models/); the config also has
  `batch_fields(data)`, and the module has `loss_and_metrics`."""
  return models.spec_for(cfg).build(cfg, rngs)


@dataclasses.dataclass(frozen=True)
class ModelSetup:
  """Everything about the params but their values, derived once from an experiment and a mesh.

  `abstract_params`: the params tree of ShapeDtypeStruct, each with its sharding (an orbax
  restore target, a jit's abstract argument); `param_shardings`: the same tree of
  NamedSharding; `param_axes`: of logical-axes tuples; `batch_sharding`: per batch field.
  """
  exp: Experiment
  mesh: Mesh
  rules: rules_lib.Rules
  graphdef: nnx.GraphDef
  abstract_params: Any
  param_shardings: Any
  param_axes: Any
  batch_sharding: dict[str, NamedSharding]

  def model(self, params) -> nnx.Module:
    """The model with `params` plugged in (inside jit: a traced, stateless view)."""
    return nnx.merge(self.graphdef, params)

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())


def create(exp: Experiment, mesh: Mesh) -> ModelSetup:
  """The model setup of `exp` on `mesh`. Works for any mesh, also one over TPU devices that
  exist only on paper (dry runs): it runs under the mesh's abstract view. Raises ValueError
  naming the field when a param or batch dim does not split over its mesh axes."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    rules = rules_lib.resolve(exp.sharding.preset, exp.sharding.rules)
    graphdef, params_abs, axes = _abstract_params(exp.model)
    shardings = params_lib.param_shardings(params_abs, axes, rules, mesh, exp.sharding.allow_uneven)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            params_abs, shardings)
    return ModelSetup(exp, mesh, rules, graphdef, abstract, shardings, axes,
                      _batch_shardings(exp, rules, mesh))


def _abstract_params(cfg: Any):
  model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise TypeError(f"model holds non-parameter state {rest}; the trainer only carries nnx.Param")
  return graphdef, nnx.to_pure_dict(params), params_lib.logical_axes_of(params)


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

