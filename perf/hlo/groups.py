"""The device groups of a collective, read from any form the compilers print.

A collective in compiled HLO names the devices that talk in one attribute, by partition
id (the position in the mesh's flat device order). The compilers write it five ways:

  explicit lists       replica_groups={{0,1},{2,3}}   (also source_target_pairs={{0,1},{1,0}})
  iota                 replica_groups=[2,4]<=[8]      iota(8) reshaped to 2 groups of 4
  transposed iota      replica_groups=[2,4]<=[4,2]T(1,0)
                                                      iota(8) as [4,2], transposed, as [2,4]
  mesh form            replica_groups=mesh['a'=2,'b'=4] {'a'}
                                                      devices that differ only along 'a'
  ... with device ids  replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}
                                                      the mesh's devices are that iota
  Shardy sub-axes      {'axis_0':(2)8}                a sub-axis of axis_0: size 8 after a
                                                      major part of size 2 (axis_0 is cut
                                                      into [2, 8, rest], major to minor)

and `replica_groups={}` means one group of every device. This module is the one place
that reads them (the report, the DCN split and the step model all call `groups`), so a
form a new compiler prints is taught once.
"""

from __future__ import annotations

import math
import re

import numpy as np

_NUM = r"\d+(?:,\d+)*"
_IOTA = re.compile(rf"\[({_NUM})\]<=\[({_NUM})\](?:T\(({_NUM})\))?")
_MESH = re.compile(rf"mesh\[([^\]]*)\](?:,\s*device_ids=\(\[({_NUM})\](?:T\(({_NUM})\))?\))?\s*\{{([^}}]*)\}}")
_LISTS = re.compile(r"\{((?:\{[\d,\s]*\},?\s*)*)\}")
# The attribute as written (used to cache routes, and to print): any of the forms above.
ATTRIBUTE = re.compile(
    rf"(?:replica_groups|source_target_pairs)=(\[{_NUM}\]<=\[{_NUM}\](?:T\({_NUM}\))?"
    rf"|mesh\[[^\]]*\](?:,\s*device_ids=\(\[{_NUM}\](?:T\({_NUM}\))?\))?\s*\{{[^}}]*\}}"
    r"|\{(?:\{[\d,\s]*\},?\s*)*\})")
_SUBAXIS = re.compile(r"^(.*?):\((\d+)\)(\d+)$")


def attribute(line: str) -> str:
  """The `replica_groups=...` / `source_target_pairs=...` attribute of one HLO line, as written
  ("" if it has none)."""
  m = ATTRIBUTE.search(line)
  return m.group(0) if m else ""


def groups(line: str, num_devices: int) -> list[list[int]]:
  """The device groups (partition ids) of one collective's HLO line or attribute."""
  m = ATTRIBUTE.search(line)
  if not m:
    return [list(range(num_devices))]
  text = m.group(1)
  if text.startswith("mesh["):
    return _mesh_groups(_MESH.match(text), num_devices)
  if i := _IOTA.match(text):
    shape = [int(s) for s in i.group(1).split(",")]
    ids = _iota(i.group(2), i.group(3))
    return ids.reshape(shape).tolist()
  found = [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]
  return [g for g in found if g] or [list(range(num_devices))]


def group_size(line: str, num_devices: int, kind: str = "") -> int:
  """Members of the first group (2 for a collective-permute: one pair)."""
  if kind == "collective-permute" or attribute(line).startswith("source_target_pairs"):
    return 2
  return len(groups(line, num_devices)[0])


def moving_pair(line: str) -> list[int]:
  """The first source-target pair of a collective-permute that moves data ([0] if none)."""
  pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", attribute(line))]
  moving = [p for p in pairs if p[0] != p[1]]
  return list(moving[0]) if moving else [0]


def _iota(shape: str, perm: str | None) -> np.ndarray:
  dims = [int(s) for s in shape.split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids.transpose([int(s) for s in perm.split(",")]) if perm else ids


def _name(text: str) -> str:
  return text.strip().strip("'\"")


def _mesh_groups(m: re.Match, num_devices: int) -> list[list[int]]:
  """mesh[axes] {reduced}: devices that differ only along the reduced (sub-)axes form a group.

  Each mesh axis is cut at the boundaries of the sub-axes named, so that every name in
  `reduced` is a run of whole factors; then the ids, as that grid of factors, are
  transposed to (kept factors, reduced factors) and read off one group per row.
  """
  axes = [(_name(n), int(v)) for n, v in (a.split("=") for a in m.group(1).split(",") if a.strip())]
  sizes = dict(axes)
  reduced = []  # (axis, pre-size, size)
  for part in (p for p in m.group(4).split(",") if p.strip()):
    part = part.strip()
    if s := _SUBAXIS.match(part):
      reduced.append((_name(s.group(1)), int(s.group(2)), int(s.group(3))))
    else:
      reduced.append((_name(part), 1, sizes.get(_name(part), 0)))
  for axis, pre, size in reduced:
    if axis not in sizes:
      raise ValueError(f"replica groups name axis {axis!r} that mesh[{m.group(1)}] does not have")
    if sizes[axis] % (pre * size):
      raise ValueError(f"sub-axis {axis}:({pre}){size} does not divide {axis}={sizes[axis]}")
  factors = []  # (axis, start, size): the mesh's axes cut into pieces, major to minor
  for axis, n in axes:
    cuts = {1, n}
    for a, pre, size in reduced:
      if a == axis:
        cuts |= {pre, pre * size}
    cuts = sorted(cuts)
    for lo, hi in zip(cuts, cuts[1:]):
      if hi % lo:
        raise ValueError(f"sub-axes of {axis}={n} overlap: {m.group(4)}")
      factors.append((axis, lo, hi // lo))
  if m.group(2):
    ids = _iota(m.group(2), m.group(3)).reshape(-1)
  else:
    ids = np.arange(math.prod(sizes.values()))
  ids = ids.reshape([f[2] for f in factors]) if factors else ids
  red = [k for k, (axis, lo, size) in enumerate(factors)
         if any(a == axis and pre <= lo and lo * size <= pre * s for a, pre, s in reduced)]
  kept = [k for k in range(len(factors)) if k not in red]
  group = math.prod(factors[k][2] for k in red)
  return ids.transpose(kept + red).reshape(-1, group).tolist()
