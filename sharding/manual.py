"""Manual (per-device) regions stated in logical axes: `shard_map` without mesh axis names.

A few layers must run their body per device under `shard_map`: a Pallas kernel the SPMD
partitioner cannot split (layers/flash.py), a top_k it would all-gather (layers/routers.py),
collectives of their own (layers/context_parallel.py). They name the dims of what enters and
leaves such a region logically, as everywhere else; this module, and only it, turns those
names into PartitionSpecs through the rules in force (`rules.use_rules`) on the current mesh
(`jax.set_mesh`), and opens the region manual over every mesh axis.

  x_layout = layout(("batch", "length", "heads", "kv"), x.shape, name="flash attention q")
  y = run(body, in_layouts=(x_layout,), out_layouts=x_layout)(x)

Each device's body sees its block of every operand: dims the rules split are cut, the rest
are whole. `Layout.whole` and `Layout.select` derive the layout of related arrays (dims left
whole; a 1-D parameter split like one dim of an activation) without restating rules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardax.sharding import rules as rules_lib
from shardax.sharding.annotate import current_mesh_shape


def active() -> bool:
  """Whether a manual region splits anything: rules in force on a mesh of more than one device."""
  mesh = jax.sharding.get_abstract_mesh()
  return rules_lib.current_rules() is not None and not mesh.empty and mesh.size > 1


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one array enters or leaves a manual region: per dim, the mesh axes that cut it
  (() = whole on every device), in the order the block index runs over them."""
  axes: tuple[tuple[str, ...], ...]

  @property
  def spec(self) -> PartitionSpec:
    """The PartitionSpec of this layout (a single axis as its name, several as a tuple)."""
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in self.axes))

  @property
  def split(self) -> bool:
    """Whether any dim is cut."""
    return any(self.axes)

  def whole(self, *dims: int) -> Layout:
    """This layout with `dims` whole on every device (the other dims as they were)."""
    return Layout(tuple(() if i in dims else a for i, a in enumerate(self.axes)))

  def select(self, *dims: int | None) -> Layout:
    """The layout of an array whose dims are dims `dims` of this one, in that order (None: a
    dim of its own, whole): e.g. a per-head parameter [heads] split as an activation's heads
    dim is, `q_layout.select(2)`."""
    return Layout(tuple(() if d is None else self.axes[d] for d in dims))

  def parts(self, dim: int) -> int:
    """Into how many blocks the current mesh cuts `dim` (1 when whole or without a mesh)."""
    mesh_shape = current_mesh_shape() or {}
    return math.prod(mesh_shape[a] for a in self.axes[dim])

  def sharding(self) -> NamedSharding:
    """This layout on the current mesh (for APIs that take a sharding, e.g. a kernel's
    `manual_sharding_spec`)."""
    return NamedSharding(jax.sharding.get_abstract_mesh(), self.spec)


def layout(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
           name: str = "tensor") -> Layout:
  """The layout the rules in force give an array whose dims are named `logical_axes` (None:
  no name, whole). With `shape`, every cut dim must divide evenly (unless
  sharding.allow_uneven), else a ValueError naming `name`, the dim and the fix. Without rules
  or a mesh, every dim is whole."""
  rules, mesh_shape = rules_lib.current_rules(), current_mesh_shape()
  if rules is None or mesh_shape is None:
    if shape is not None and len(shape) != len(logical_axes):
      raise ValueError(f"{name}: logical axes {tuple(logical_axes)} name {len(logical_axes)} dims "
                       f"but the shape {tuple(shape)} has {len(shape)}")
    return Layout(tuple(() for _ in logical_axes))
  spec = rules_lib.logical_to_spec(logical_axes, rules, mesh_shape, shape, name=name,
                                   allow_uneven=rules_lib.allow_uneven())
  return Layout(tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec))


def _spec(entry: Any) -> Any:
  return entry.spec if isinstance(entry, Layout) else entry


def run(fn: Callable, in_layouts: Sequence[Any], out_layouts: Any) -> Callable:
  """`fn` as a manual region over every axis of the current mesh: each argument enters cut
  as its entry of `in_layouts` says, each output leaves as `out_layouts` says (a Layout, or a
  tuple of them for several outputs). An entry may also be a pytree of PartitionSpecs that a
  kernel gives for its own operands (splash's `manual_sharding_spec`). A None argument
  passes through as None. Without `active()` rules and mesh, `fn` itself.

  The body is not checked for varying-manual-axes types (check_vma=False): the layers that
  use it reduce over the axes they need themselves."""
  if not active():
    return fn
  specs = lambda tree: jax.tree.map(_spec, tree, is_leaf=lambda x: isinstance(x, (Layout, PartitionSpec)))
  out_specs, in_specs = specs(out_layouts), tuple(specs(e) for e in in_layouts)
  mesh = jax.sharding.get_abstract_mesh()

  def call(*args):
    if len(args) != len(in_specs):
      raise ValueError(f"manual region: {len(args)} arguments for {len(in_specs)} in_layouts")
    present = [i for i, a in enumerate(args) if a is not None]

    def body(*given):
      full = [None] * len(args)
      for i, a in zip(present, given):
        full[i] = a
      return fn(*full)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs[i] for i in present),
                         out_specs=out_specs, check_vma=False)(*(args[i] for i in present))
  return call
