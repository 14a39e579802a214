"""MeshConfig -> jax Mesh.

A mesh is a grid of devices with named axes. On one slice every axis runs over
fast ICI links; with several slices (TPU multi-slice, or several GPU hosts) the
outer grid runs over slower DCN links, so each axis is ICI size x DCN size and
the DCN factor should sit on the axes that communicate least (usually `data`).

All axes are `AxisType.Auto`: GSPMD-style, the compiler completes shardings
from our annotations (jax >= 0.9 defaults to Explicit axes, which we do not want).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Shape and names of the device mesh.

  ici: per-slice shape, one entry per axis; a single -1 takes what is left.
  dcn: number of slices along each axis (multi-slice); () means one slice.
  axes: axis names, one per entry of `ici`.
  num_cpu_devices: simulate this many devices on a CPU (must be set before jax starts).
  topology: a TPU topology name such as "v5e:2x2" for ahead-of-time dry runs.
  """
  ici: tuple[int, ...] = (-1, 1)
  dcn: tuple[int, ...] = ()
  axes: tuple[str, ...] = ("data", "model")
  num_cpu_devices: int | None = None
  topology: str | None = None

  def __post_init__(self):
    ici, dcn = tuple(self.ici), tuple(self.dcn)
    if len(ici) != len(self.axes):
      raise ValueError(f"mesh.ici={ici} has {len(ici)} entries but mesh.axes={self.axes} has "
                       f"{len(self.axes)}; give one size per axis name")
    if dcn and len(dcn) != len(self.axes):
      raise ValueError(f"mesh.dcn={dcn} needs one entry per axis in mesh.axes={self.axes}")
    if len(set(self.axes)) != len(self.axes):
      raise ValueError(f"mesh.axes={self.axes} repeats a name")
    for name, shape in (("ici", ici), ("dcn", dcn)):
      if sum(1 for s in shape if s == -1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh.{name}={shape}: sizes must be positive, with at most one -1")


def resolve_shape(shape: Sequence[int], num: int, what: str) -> tuple[int, ...]:
  """Replace a single -1 so that the product is `num`; check the product otherwise."""
  shape = tuple(int(s) for s in shape)
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num % known:
      raise ValueError(f"{what} {shape}: the fixed sizes (product {known}) do not divide "
                       f"the {num} devices available")
    shape = tuple(num // known if s == -1 else s for s in shape)
  if math.prod(shape) != num:
    raise ValueError(f"{what} {shape} needs {math.prod(shape)} devices, {num} are available; "
                     f"change --set mesh.ici (a -1 entry fills the rest)")
  return shape


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Build the mesh, in a topology-aware device order where jax offers one.

  Without `devices`: the TPU devices of `cfg.topology` when set (for AOT dry runs;
  see sharding/topology.py), else this process's devices.
  """
  if devices is None and cfg.topology:
    from shardax.sharding import topology
    slices = math.prod(cfg.dcn) if cfg.dcn and -1 not in cfg.dcn else 1
    devices = topology.devices(cfg.topology, slices)
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  axis_types = (AxisType.Auto,) * len(cfg.axes)
  if cfg.dcn:
    num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    dcn = resolve_shape(cfg.dcn, num_slices, "mesh.dcn (slices)")
    ici = resolve_shape(cfg.ici, n // num_slices, "mesh.ici (per slice)")
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
    return Mesh(grid, cfg.axes, axis_types=axis_types)
  shape = resolve_shape(cfg.ici, n, "mesh")
  try:
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.array(devices).reshape(shape)
  return Mesh(grid, cfg.axes, axis_types=axis_types)
