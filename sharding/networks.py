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

import re
from typing import Iterable

import numpy as np

from shardax.sharding import replica_groups

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\b(all-reduce|all-gather|reduce-scatter|"
                    r"all-to-all|collective-permute)(?:-start)?\(")
_MEGASCALE = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*\((\w+)\[([\d,]*)\].*?\ssend\(.*"
                        r"_xla_megascale_transfer_type=\"?(\w+)")
_MEGASCALE_KIND = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                   "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}
def granule_ids(mesh) -> list[int]:
  """Granule of each partition id: TPU slice index, else process index (as mesh.granules)."""
  devices = list(mesh.devices.flat)
  if devices[0].platform == "tpu":
    return [getattr(d, "slice_index", 0) for d in devices]
  return [d.process_index for d in devices]


def _add(table: dict, kind: str, nbytes: int, runs: int = 1) -> None:
  row = table.setdefault(kind, {"count": 0, "bytes": 0})
  row["count"] += runs
  row["bytes"] += nbytes * runs


def megascale_transfers(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {count, bytes}} of a multi-slice TPU program's DCN sends (each appearance once)."""
  out: dict[str, dict[str, int]] = {}
  for line in hlo_text.splitlines():
    if m := _MEGASCALE.match(line):
      _, dtype, dims, transfer = m.groups()
      n = int(np.prod([int(d) for d in dims.split(",") if d])) * _DTYPE_BYTES.get(dtype, 4)
      _add(out, _MEGASCALE_KIND.get(transfer, transfer.lower()), n)
  return out


def classify(hlo_text: str, granule: list[int], collectives: Iterable) -> dict[str, dict[str, dict[str, int]]]:
  """{"ici": {kind: {count, bytes}}, "dcn": {...}}: the pure core, over the granule of each partition id.

  `collectives`: objects with `name`, `kind`, `bytes` and `executions` (report.Collective).
  """
  out: dict[str, dict[str, dict[str, int]]] = {"ici": {}, "dcn": {}}
  megascale = megascale_transfers(hlo_text)
  crosses: dict[str, bool] = {}
  if not megascale:  # GPU/CPU hosts: a collective crosses DCN when one of its groups spans granules
    for line in hlo_text.splitlines():
      if m := _INSTR.match(line):
        groups = replica_groups.groups(line, len(granule))
        crosses[m.group(1)] = any(len({granule[i] for i in g}) > 1 for g in groups)
  for c in collectives:
    _add(out["dcn" if crosses.get(c.name, False) else "ici"], c.kind, c.bytes, getattr(c, "executions", 1))
  for kind, row in megascale.items():
    _add(out["dcn"], kind, row["bytes"] // max(row["count"], 1), row["count"])
  return out


def split_by_network(hlo_text: str, mesh, collectives: Iterable) -> dict[str, dict[str, dict[str, int]]]:
  """`classify` for a program compiled for `mesh` (granules as in mesh.granules)."""
  return classify(hlo_text, granule_ids(mesh), collectives)
