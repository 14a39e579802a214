"""Which collectives stay on ICI and which cross DCN, read from the compiled program.

With several granules (TPU slices, or GPU/CPU hosts: see mesh.granules) a collective
whose device groups all lie inside one granule runs over the fast interconnect (ICI,
NVLink); one whose groups span granules crosses the data-center network (DCN), which
is an order of magnitude slower. The compiled HLO names each collective's groups
(`replica_groups`, `source_target_pairs`) by partition id, i.e. by position in the
mesh's flat device order, so the granule of every member is known.

A multi-slice TPU program looks different: the TPU compiler keeps every HLO
collective inside a slice and lowers the cross-slice part to host transfers
(`send`/`recv` with `_xla_megascale_transfer_type`, e.g. ALL_REDUCE, ALL_GATHER)
run by the megascale DCN runtime. Those sends are the DCN traffic.
"""

from __future__ import annotations

from typing import Iterable

from shardax.perf import hlo

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")


def granule_ids(mesh) -> list[int]:
  """Granule of each partition id (mesh.granule_of: TPU slice, else host)."""
  from shardax.sharding import mesh as mesh_lib
  return [mesh_lib.granule_of(d) for d in mesh.devices.flat]


def _add(table: dict, kind: str, nbytes: int, runs: int = 1) -> None:
  row = table.setdefault(kind, {"count": 0, "bytes": 0})
  row["count"] += runs
  row["bytes"] += nbytes * runs


def classify(hlo_text: str, granule: list[int], collectives: Iterable) -> dict[str, dict[str, dict[str, int]]]:
  """{"ici": {kind: {count, bytes}}, "dcn": {...}}: the pure core, over the granule of each partition id.

  `collectives`: objects with `name`, `kind`, `bytes` and `executions` (report.Collective).
  """
  out: dict[str, dict[str, dict[str, int]]] = {"ici": {}, "dcn": {}}
  collectives = list(collectives)
  crosses: dict[str, bool] = {}
  if not any(getattr(c, "link", "") == "dcn" for c in collectives):
    # GPU/CPU hosts: a collective crosses DCN when one of its groups spans granules
    for inst in hlo.parse(hlo_text):
      if inst.opcode.removesuffix("-start") in _KINDS:
        groups = inst.device_groups(len(granule))
        crosses[inst.name] = any(len({granule[i] for i in g}) > 1 for g in groups)
  for c in collectives:
    dcn = getattr(c, "link", "") == "dcn" or crosses.get(c.name, False)
    _add(out["dcn" if dcn else "ici"], c.kind, c.bytes, getattr(c, "executions", 1))
  return out


def split_by_network(hlo_text: str, mesh, collectives: Iterable) -> dict[str, dict[str, dict[str, int]]]:
  """`classify` for a program compiled for `mesh` (granules as in mesh.granules)."""
  return classify(hlo_text, granule_ids(mesh), collectives)
