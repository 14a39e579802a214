"""Shardings of a model's parameters, from the `logical_axes` each param carries.

Layers tag every `nnx.Param` with `logical_axes=(name per dim)`; here, and only
here, those names meet an experiment's rules and a concrete mesh.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.sharding import rules as rules_lib


def logical_axes_of(state: nnx.State) -> dict:
  """Pure nested dict path -> logical axes tuple (one per dim), mirroring `nnx.to_pure_dict`."""
  def axes(v):
    names = v.get_metadata().get("logical_axes")
    if names is None:
      return (None,) * len(v.value.shape)
    return tuple(names)
  return nnx.to_pure_dict(jax.tree.map(lambda v: v.replace(value=axes(v)), state,
                                       is_leaf=lambda x: isinstance(x, nnx.Variable)))


def param_shardings(abstract: Any, axes: Any, rules: rules_lib.Rules, mesh: Mesh,
                    allow_uneven: bool = False) -> Any:
  """NamedSharding for each leaf of `abstract` (pure dict of shape structs) from `axes`."""
  mesh_shape = dict(mesh.shape)

  def one(path, leaf, names):
    spec = rules_lib.logical_to_spec(names, rules, mesh_shape, leaf.shape,
                                     name=f"param {jax.tree_util.keystr(path, simple=True, separator='/')}",
                                     allow_uneven=allow_uneven)
    return NamedSharding(mesh, spec)

  flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  return jax.tree.unflatten(treedef, [one(p, l, a) for (p, l), a in zip(flat, flat_axes, strict=True)])


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
