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
import os
import re
from typing import Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh

from shardax.perf.hardware import NETWORKS


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Shape and names of the device mesh.

  ici: per-slice shape, one entry per axis; a single -1 takes what is left.
  dcn: number of slices along each axis (multi-slice); () means one slice.
  axes: axis names, one per entry of `ici`.
  num_cpu_devices: simulate this many devices on a CPU (must be set before jax starts).
  topology: a TPU topology name such as "v5e:2x2" for ahead-of-time dry runs.
  network: the data-center network between granules, by name, for the step-time model
    (perf/hardware.NETWORKS: "a3-high", "a3-mega", "a3-ultra", "a4", "infiniband-ndr",
    "infiniband-hdr"); None: the chip's default (TPU: its hosts' NICs; GPU: A3 High).
  libtpu_flags: TPU compiler flags the CLI adds to LIBTPU_INIT_ARGS before jax starts
    (sharding/libtpu_flags.py; a flag the user set there keeps the user's value).
  """
  ici: tuple[int, ...] = (-1, 1)
  dcn: tuple[int, ...] = ()
  axes: tuple[str, ...] = ("data", "model")
  num_cpu_devices: int | None = None
  topology: str | None = None
  network: str | None = None
  libtpu_flags: tuple[str, ...] = ()

  def __post_init__(self):
    ici, dcn = tuple(self.ici), tuple(self.dcn)
    if len(ici) != len(self.axes):
      raise ValueError(f"mesh.ici={ici} has {len(ici)} entries but mesh.axes={self.axes} has "
                       f"{len(self.axes)}; give one size per axis name")
    if dcn and len(dcn) != len(self.axes):
      raise ValueError(f"mesh.dcn={dcn} needs one entry per axis in mesh.axes={self.axes}")
    if len(set(self.axes)) != len(self.axes):
      raise ValueError(f"mesh.axes={self.axes} repeats a name")
    if self.network is not None and self.network not in NETWORKS:
      raise ValueError(f"mesh.network={self.network!r} is not a network the step-time model knows; "
                       f"use one of {sorted(NETWORKS)} or leave it unset (None) for the chip's default")
    from shardax.sharding import libtpu_flags
    libtpu_flags.check(self.libtpu_flags)
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


_PLURAL = {"slice": "slices", "host": "hosts"}
# Launchers that say how many processes share a node (ranks are node-major under each).
_LOCAL_SIZE_VARS = ("SHARDAX_PROCESSES_PER_HOST", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE", "MPI_LOCALNRANKS")


def processes_per_host() -> int:
  """How many processes run on each host: 1 unless a launcher (or SHARDAX_PROCESSES_PER_HOST) says more.

  A GPU job may run one process per GPU (8 per node); a granule is still the node, since
  its GPUs talk over NVLink and only the node's NICs reach the network.
  """
  for var in _LOCAL_SIZE_VARS:
    value = os.environ.get(var, "")
    if m := re.match(r"\d+", value):   # SLURM writes "8(x2)" for 8 tasks on each of 2 nodes
      return max(1, int(m.group(0)))
  return 1


# Launchers that say which node a process runs on (any order of ranks).
NODE_ID_VARS = ("SHARDAX_NODE_ID", "SLURM_NODEID", "GROUP_RANK", "NODE_RANK", "OMPI_COMM_WORLD_NODE_RANK")
_host_of_process: dict[int, int] | None = None   # set once per job by set_node_ids


def node_id() -> int | None:
  """This process's node id from the launcher (SHARDAX_NODE_ID wins), or None."""
  for var in NODE_ID_VARS:
    if m := re.fullmatch(r"\s*(\d+)\s*", os.environ.get(var, "")):
      return int(m.group(1))
  return None


def set_node_ids(ids: Sequence[int | None] | None) -> dict[int, int] | None:
  """Every process's node id (index = process index), gathered at start
  (trainer/distributed.py): processes on one node form one host granule, numbered in
  order of their first process. None, or no ids at all, clears it (processes per host
  then decide). Returns {process: host}."""
  global _host_of_process
  if not ids or all(i is None for i in ids):
    _host_of_process = None
    return None
  if any(i is None for i in ids):
    missing = [p for p, i in enumerate(ids) if i is None]
    raise ValueError(f"processes {missing} have no node id while others do ({NODE_ID_VARS[0]} or "
                     f"the launcher's {', '.join(NODE_ID_VARS[1:])}); set it on every process")
  hosts = {n: h for h, n in enumerate(dict.fromkeys(ids))}
  _host_of_process = {p: hosts[n] for p, n in enumerate(ids)}
  return dict(_host_of_process)


def granule_kind(device) -> str:
  """"slice" on TPUs (slices are joined by DCN), else "host" (a node: GPUs, CPUs)."""
  return "slice" if device.platform == "tpu" else "host"


def granule_of(device, per_host: int | None = None) -> int:
  """The DCN granule of one device: the one definition the mesh, the report and the step model use.

  TPU: its slice (`slice_index`; a single-slice topology may omit it: 0). GPU and CPU:
  its host, whatever the launcher ran per node (one process per host or one per GPU):
  the node its process runs on when the launcher names nodes (`set_node_ids`), else its
  process index over the processes per host (ranks node-major).
  """
  if granule_kind(device) == "slice":
    return int(getattr(device, "slice_index", 0) or 0)
  if _host_of_process is not None and int(device.process_index) in _host_of_process:
    return _host_of_process[int(device.process_index)]
  return int(device.process_index) // (per_host or processes_per_host())


def processes_share_hosts() -> bool:
  """Whether some host runs several of the job's processes (then jax's granule, the
  process, is not ours)."""
  if _host_of_process is not None:
    return len(set(_host_of_process.values())) < len(_host_of_process)
  return processes_per_host() > 1


def granules(devices: Sequence[jax.Device]) -> tuple[str, list[list[jax.Device]]]:
  """The DCN granules the devices fall into (see `granule_of`), with their kind."""
  if not devices:
    return "host", []
  kind, per_host = granule_kind(devices[0]), processes_per_host()
  groups: dict[int, list[jax.Device]] = {}
  for d in devices:
    groups.setdefault(granule_of(d, per_host), []).append(d)
  return kind, [groups[k] for k in sorted(groups)]


def _hybrid_grid(cfg: MeshConfig, devices: Sequence[jax.Device]) -> np.ndarray:
  """The (ici x dcn) device grid: each axis is ICI size times DCN size, granules outermost."""
  kind, groups = granules(devices)
  sizes = {len(g) for g in groups}
  if len(sizes) != 1:
    raise ValueError(f"mesh.dcn={tuple(cfg.dcn)}: the {len(groups)} {_PLURAL[kind]} found hold different "
                     f"device counts {sorted(sizes)}; every granule needs the same number of devices")
  how = ("start the job on that many hosts (docs/hosts.md: running on many hosts)" if kind == "host"
         else "use a multi-slice TPU job (or mesh.topology with dry_run)")
  dcn = tuple(int(d) for d in cfg.dcn)
  if -1 in dcn and len(groups) % math.prod(d for d in dcn if d != -1) == 0:
    dcn = tuple(len(groups) // math.prod(d for d in dcn if d != -1) if d == -1 else d for d in dcn)
  if math.prod(dcn) != len(groups):
    raise ValueError(f"mesh.dcn={tuple(cfg.dcn)} needs {math.prod(d for d in dcn if d != -1)}"
                     f"{' x N' if -1 in dcn else ''} granules ({_PLURAL[kind]} joined by DCN), "
                     f"{len(groups)} {kind if len(groups) == 1 else _PLURAL[kind]} found: {how}, or drop mesh.dcn")
  ici = resolve_shape(cfg.ici, sizes.pop(), f"mesh.ici (devices per {kind})")
  logging.info("mesh.dcn=%s over %d %s: %s", dcn, len(groups), _PLURAL[kind], "; ".join(
      f"{kind} {k}: processes {sorted({d.process_index for d in g})}" for k, g in enumerate(groups)))
  from jax.experimental import mesh_utils
  try:
    if kind == "host" and processes_share_hosts():  # jax's granule would be the process
      raise NotImplementedError("several processes per host")
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                process_is_granule=kind == "host")
  except (ValueError, NotImplementedError, AssertionError) as e:
    if kind == "slice" or not processes_share_hosts():
      _warn_plain_order(ici, groups[0], e)
    # Each granule in plain order, granules outermost on every axis (as jax lays them out).
    grid = np.array([np.array(g).reshape(ici) for g in groups]).reshape(dcn + ici)
    n = len(ici)
    return grid.transpose([k for j in range(n) for k in (j, n + j)]).reshape(
        [d * i for d, i in zip(dcn, ici)])


def _single_grid(cfg: MeshConfig, devices: Sequence[jax.Device]) -> np.ndarray:
  """The device grid in the interconnect's order; plain order (with a warning) when jax has none."""
  shape = resolve_shape(cfg.ici, len(devices), "mesh")
  from jax.experimental import mesh_utils
  try:
    return mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, NotImplementedError, AssertionError) as e:
    _warn_plain_order(shape, devices, e)
    return np.array(devices).reshape(shape)


def _warn_plain_order(shape, devices: Sequence[jax.Device], error: Exception) -> None:
  logging.warning(
      "mesh %s does not fit the physical layout of these %d %s devices (%s); laying them out in "
      "plain device order, so some mesh axes span non-neighbouring chips and their collectives "
      "are slower. Prefer a mesh.ici whose sizes follow the topology's dimensions.",
      shape, len(devices), devices[0].device_kind, str(error).splitlines()[0][:200])


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Build the mesh, in a topology-aware device order where jax offers one.

  Without `devices`: the TPU devices of `cfg.topology` when set (for AOT dry runs;
  see sharding/topology.py), else all devices of the job (every process's).
  With `cfg.dcn`, the devices split into granules (TPU slices, or processes on GPUs
  and CPUs) and each mesh axis is `ici[i] * dcn[i]` long, granules outermost.
  """
  if devices is None and cfg.topology:
    from shardax.sharding import topology
    slices = math.prod(cfg.dcn) if cfg.dcn and -1 not in cfg.dcn else 1
    devices = topology.devices(cfg.topology, slices)
  devices = list(jax.devices() if devices is None else devices)
  grid = _hybrid_grid(cfg, devices) if cfg.dcn else _single_grid(cfg, devices)
  return Mesh(grid, cfg.axes, axis_types=(AxisType.Auto,) * len(cfg.axes))
