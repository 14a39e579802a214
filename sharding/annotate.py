"""The two annotations model code uses: `mesh_split` (mesh axes) and `shard` (logical).

Both read the current mesh (`jax.set_mesh`) and do nothing without one or on a
single device, so the same model code runs unchanged on a laptop and a pod.
Inside `jit` they become sharding constraints that the partitioner propagates
from; outside they reshard a concrete array.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec

from shardax.sharding import rules as rules_lib


def current_mesh_shape() -> dict[str, int] | None:
  """Axis name -> size of the mesh in force, or None when there is no mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  return dict(mesh.shape)


def _entry_axes(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
    return tuple(entry)
  raise ValueError(f"dims_mapping entry {entry!r} must be a mesh axis name, a tuple of names, or None")


def spec_for(shape: Sequence[int], dims_mapping: Sequence[Any],
             mesh_shape: dict[str, int] | None) -> PartitionSpec:
  """Validate `dims_mapping` for `shape` and turn it into a PartitionSpec."""
  shape, dims_mapping = tuple(shape), tuple(dims_mapping)
  where = f"mesh_split of a tensor of shape {shape} with dims_mapping {dims_mapping}"
  if len(dims_mapping) != len(shape):
    raise ValueError(f"{where}: needs one entry per dim ({len(shape)}), got {len(dims_mapping)}")
  seen: set[str] = set()
  for entry in dims_mapping:
    for axis in _entry_axes(entry):
      if axis in seen:
        raise ValueError(f"{where}: mesh axis {axis!r} is used by more than one dim")
      seen.add(axis)
      if mesh_shape is not None and axis not in mesh_shape:
        raise ValueError(f"{where}: unknown mesh axis {axis!r}; the mesh has {tuple(mesh_shape)}")
  return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in dims_mapping))


def mesh_split(x: jax.Array, dims_mapping: Sequence[Any]) -> jax.Array:
  """Split `x` over the current mesh: one entry per dim (axis name, tuple of names, or None)."""
  mesh_shape = current_mesh_shape()
  spec = spec_for(x.shape, dims_mapping, mesh_shape)
  if mesh_shape is None or jax.sharding.get_abstract_mesh().size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, spec)


def shard(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Split `x` by its logical dim names through the rules in force (`use_rules`).

  No mesh, no rules or one device: `x` unchanged. This is the call model code makes.
  """
  rules = rules_lib.current_rules()
  mesh_shape = current_mesh_shape()
  if rules is None or mesh_shape is None or jax.sharding.get_abstract_mesh().size == 1:
    if len(logical_axes) != x.ndim:
      raise ValueError(f"shard: logical axes {tuple(logical_axes)} do not match the rank of shape {x.shape}")
    return x
  spec = rules_lib.logical_to_spec(logical_axes, rules, mesh_shape, x.shape,
                                   name=f"activation {tuple(logical_axes)}",
                                   allow_uneven=rules_lib.allow_uneven())
  return jax.lax.with_sharding_constraint(x, spec)
