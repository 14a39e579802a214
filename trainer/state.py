"""Train state, born sharded: the model setup (trainer/model_setup.py) plus the optimizer.

From the params' logical axes and the experiment's rules come the optimizer state's
shardings; a jitted init with those out_shardings then creates every array directly on
its devices, so no process ever holds the full model.

The state is a plain pytree: {"step": int32[], "params": {...}, "opt_state": optax state}.
Only training (and import, which writes a step-0 train state) builds a `Setup`; eval,
decode and export work from a `ModelSetup` and never build the optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardax.configs.schema import Experiment
from shardax.sharding import rules as rules_lib
from shardax.trainer import model_setup as model_setup_lib
from shardax.trainer import optimizer
from shardax.trainer.model_setup import ModelSetup


@dataclasses.dataclass(frozen=True)
class Setup:
  """The training setup: a `ModelSetup` (held, not inherited) plus the optimizer `tx`, and
  the whole state's `abstract` tree (ShapeDtypeStruct leaves, each with its sharding) and
  `shardings` tree, keyed "step", "params", "opt_state". The model setup's fields read
  through (`setup.mesh`, `setup.model(params)`, ...), so code that needs only the model
  takes either setup."""
  model_setup: ModelSetup
  tx: optax.GradientTransformation
  abstract: Any
  shardings: Any

  exp = property(lambda self: self.model_setup.exp)
  mesh = property(lambda self: self.model_setup.mesh)
  rules = property(lambda self: self.model_setup.rules)
  graphdef = property(lambda self: self.model_setup.graphdef)
  abstract_params = property(lambda self: self.model_setup.abstract_params)
  param_shardings = property(lambda self: self.model_setup.param_shardings)
  param_axes = property(lambda self: self.model_setup.param_axes)
  batch_sharding = property(lambda self: self.model_setup.batch_sharding)
  replicated = property(lambda self: self.model_setup.replicated)

  def model(self, params) -> nnx.Module:
    """The model with `params` plugged in (inside jit: a traced, stateless view)."""
    return self.model_setup.model(params)


def create(exp: Experiment, mesh: Mesh) -> Setup:
  """Everything about the train state but its values (`with_optimizer` of the model setup).
  Works for any mesh, also one over TPU devices that exist only on paper (dry runs)."""
  return with_optimizer(model_setup_lib.create(exp, mesh))


def with_optimizer(model: ModelSetup) -> Setup:
  """The training setup on top of `model`: the experiment's optimizer and its state's
  abstract shapes and shardings. Runs under the mesh's abstract view, so the few tiny
  eager ops optax makes while building its state tree stay on the host."""
  with jax.sharding.use_abstract_mesh(model.mesh.abstract_mesh):
    exp, mesh = model.exp, model.mesh
    params_abs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), model.abstract_params)
    tx = optimizer.make(exp.optimizer, exp.train.steps, params_abs, model.param_axes)
    opt_abs = jax.eval_shape(tx.init, params_abs)
    opt_sh = _opt_state_shardings(exp, opt_abs, params_abs, model.param_axes, model.rules, mesh)
    shardings = {"step": model.replicated, "params": model.param_shardings, "opt_state": opt_sh}
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=model.replicated),
                "params": model.abstract_params,
                "opt_state": jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                          opt_abs, opt_sh)}
    return Setup(model, tx, abstract, shardings)


def _opt_state_shardings(exp: Experiment, opt_abs, params_abs, axes, rules, mesh: Mesh):
  """Optimizer state split along the logical axes of the param dims it keeps: moments
  and master copies exactly like their params, factored moments like the kept dims."""
  mesh_shape = dict(mesh.shape)

  def sharding(names, leaf):
    spec = rules_lib.logical_to_spec(names, rules, mesh_shape, leaf.shape, name="optimizer state",
                                     allow_uneven=exp.sharding.allow_uneven)
    return NamedSharding(mesh, spec)

  return optimizer.map_state_axes(opt_abs, params_abs, axes, sharding)


def init_fn(setup: Setup) -> Callable[[jax.Array], Any]:
  """A jitted `key -> state` whose outputs are created already sharded."""
  cfg, tx = setup.exp.model, setup.tx

  def init(key):
    model = model_setup_lib.build_model(cfg, nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

  return jax.jit(init, out_shardings=setup.shardings)


def count_params(setup: ModelSetup | Setup) -> int:
  """Parameters of the model (either setup)."""
  return sum(int(x.size) for x in jax.tree.leaves(setup.abstract_params))
