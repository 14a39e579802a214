"""Which links a collective crosses, and how long it takes on them.

A collective's replica groups (in the compiled HLO: partition ids, the positions of
`mesh.devices.flat`) name the devices that talk. From the devices themselves we
read where they sit: TPU torus coordinates, the TensorCore on a v3 chip, the slice
(TPU multi-slice) or node (GPU host) index. Then, for one group:

  ICI (one slice): the torus dims along which members differ. A ring collective over
    one dim uses both directions of its links when the dim closes into a ring
    (wraparound: the group spans the whole dim, and the dim is long enough for the
    chip's torus to wrap it), else only one (an open chain): bandwidth per device =
    link x (2 if wraparound else 1), summed over the dims spanned (XLA runs a
    multi-dim collective as concurrent rings). TPU v3's two cores share a chip's
    links: / devices_per_chip. Members on one chip only: on-chip, at HBM speed.
    GPUs: NVSwitch, every peer at the NVLink rate.
  DCN: members in g_dcn slices/nodes. Hierarchical: the ICI part runs first, then
    1/g_ici of the buffer crosses the DCN at the chip's DCN rate.

Time of one execution, B the full buffer (sharding/report.py), g the group size:
  all-gather, reduce-scatter   B (g-1)/g / bw
  all-reduce                   2 B (g-1)/g / bw     (reduce-scatter + all-gather)
  all-to-all                   B (g-1)/g / bw x hops on a torus, x 1 through a switch:
                               hops = the mean distance a byte travels, the sum over the
                               torus dims the group spans of k/4 for k members along the dim
                               (a ring's; a 1D group of g: g/4, as before). Not g/4 for a
                               group over several dims: 2048 v3 cores on a 32x32 torus are
                               8 + 8 hops apart on average, not 512.
  collective-permute           B / one link
plus a fixed latency per op (5 us ICI, 50 us DCN): small next to the transfers of
real models, but it keeps thousands of tiny ops from reading as free.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from shardax.sharding import mesh as mesh_lib
from shardax.perf.hlo import groups as replica_groups
from shardax.perf.hardware import Chip

ICI_LATENCY, DCN_LATENCY = 5e-6, 50e-6


@dataclasses.dataclass(frozen=True)
class Route:
  """Where one replica group's members sit."""
  size: int
  ici_size: int                   # members per slice/node
  dcn_size: int                   # slices/nodes spanned
  dims: tuple[tuple[int, bool], ...] = ()  # torus dims spanned: (members along it, wraparound)
  on_chip: bool = False           # only the cores of one chip (TPU v3)
  axes: tuple[str, ...] = ()      # mesh axes along which members differ


def first_group(attr: str, num: int) -> list[int]:
  """Partition ids of the first replica group (or the first moving source-target pair) of a
  collective's attribute (perf/hlo/groups.py reads every form)."""
  if attr.startswith("source_target_pairs="):
    return replica_groups.moving_pair(attr)
  return replica_groups.groups(attr, num)[0]


def route(devices: np.ndarray, axis_names: tuple[str, ...], group: list[int]) -> Route:
  """Where the members of `group` (positions in `devices.flat`) sit."""
  flat = devices.ravel()
  group = list(dict.fromkeys(group))
  members = [flat[i] for i in group if i < flat.size]
  positions = [np.unravel_index(i, devices.shape) for i in group if i < flat.size]
  axes = tuple(a for k, a in enumerate(axis_names) if len({p[k] for p in positions}) > 1)
  per_host = mesh_lib.processes_per_host()
  slice_of = lambda d: mesh_lib.granule_of(d, per_host)
  slices = {slice_of(d) for d in members}
  local = [d for d in members if slice_of(d) == slice_of(members[0])]
  coords = [tuple(getattr(d, "coords", ())) for d in local]
  extent = _extent(tuple(tuple(getattr(d, "coords", ())) for d in flat))
  dims = []
  for k in range(len(coords[0]) if coords and coords[0] else 0):
    along = len({c[k] for c in coords})
    if along > 1:
      dims.append((along, along == extent[k]))
  on_chip = len(local) > 1 and len(set(coords)) == 1
  return Route(len(members), len(local), len(slices), tuple(dims), on_chip, axes)


@functools.lru_cache(maxsize=64)
def _extent(coords: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
  if not coords or not coords[0]:
    return ()
  return tuple(max(c[k] for c in coords) + 1 for k in range(len(coords[0])))


def ici_bandwidth(chip: Chip, r: Route) -> float:
  """Bytes/s one device moves in a ring collective over the ICI part of `r`."""
  if chip.torus_dims == 0:          # GPU: NVSwitch
    return chip.ici_link_bandwidth
  if r.on_chip:
    return chip.hbm_bandwidth / 2
  per_link = chip.ici_link_bandwidth / chip.devices_per_chip
  wraps = lambda size, full: full and size >= chip.wraparound_from
  return sum(per_link * (2 if wraps(size, full) else 1) for size, full in r.dims) or per_link


def _hops(r: Route, g: int) -> float:
  """Mean torus distance between two members of the group `r` (at least 1): k/4 per dim of k
  members (a ring's, both ways round; an open chain's k/3 is not used, so 1D groups keep the
  figure they had). The bytes of an all-to-all travel that far on average, over the links
  whose bandwidth `ici_bandwidth` sums; dims add, they do not multiply."""
  return max(1.0, sum(k / 4 for k, _ in r.dims) if r.dims else g / 4)


def across_granules(size: int) -> Route:
  """The route of a transfer between `size` granules, one member in each: a multi-slice TPU
  program's megascale send (report.Collective.link == "dcn"), whose in-slice part the
  program runs as its own HLO collectives."""
  return Route(size, 1, size)


def seconds(kind: str, nbytes: float, r: Route, chip: Chip) -> float:
  """Time of one execution of a collective of `kind` moving an `nbytes` buffer over `r`."""
  return sum(seconds_by_link(kind, nbytes, r, chip).values())


def seconds_by_link(kind: str, nbytes: float, r: Route, chip: Chip) -> dict[str, float]:
  """`seconds`, split into the time on ICI (or NVLink) and on DCN (the data-center network)."""
  out = {"ici": 0.0, "dcn": 0.0}
  if r.size <= 1 or nbytes <= 0:
    return out
  if kind == "collective-permute":
    if r.dcn_size > 1:
      out["dcn"] = nbytes / chip.dcn_bandwidth + DCN_LATENCY
    else:
      link = chip.hbm_bandwidth / 2 if r.on_chip else chip.ici_link_bandwidth / chip.devices_per_chip
      out["ici"] = nbytes / link + ICI_LATENCY
    return out
  factor = {"all-reduce": 2.0}.get(kind, 1.0)
  if r.ici_size > 1:
    g = r.ici_size
    spread = _hops(r, g) if kind == "all-to-all" and chip.torus_dims else 1.0
    out["ici"] = factor * nbytes * (g - 1) / g / ici_bandwidth(chip, r) * spread + ICI_LATENCY
  if r.dcn_size > 1:
    g = r.dcn_size
    out["dcn"] = factor * (nbytes / r.ici_size) * (g - 1) / g / chip.dcn_bandwidth + DCN_LATENCY
  return out
