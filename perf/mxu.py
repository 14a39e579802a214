"""What a chip's matrix units make of the program's matmul shapes: padding to the MXU tile.

A TPU MXU is a weight-stationary systolic array of `mxu_dim` x `mxu_dim` multiply-adds
(128 x 128 up to v5p, 256 x 256 on v6e: perf/hardware.py, with sources). A dot
[M, K] x [K, N] runs as tiles: one operand's K x (N or M) block sits in the array, the
other streams through it. Each tile is a full array whatever the shape, so the array does
pad(K) x pad(held) multiply-adds per streamed row, pad(x) = x rounded up to `mxu_dim`.
The share of the peak a dot can reach is therefore

    K / pad(K) x max(N / pad(N), M / pad(M))

(the compiler holds whichever operand wastes less). For K = 128 (a 128-wide attention
head's QK^T, the PV product's output width) that is 1 on a 128 MXU and 1/2 on a 256 MXU.
The step model's `matmul_efficiency` (0.8, chips.py) is what large matmuls reach when
nothing pads (every dim a multiple of 128 on a 128 MXU, as in the rows it was set
against); a piece of the program runs at that times its dots' FLOP-weighted
utilization (`by_piece`). GPUs have no weight-stationary array (tensor cores take small
fragments, the GEMM kernel picks its tiles): their utilization is taken as 1.

Shapes are read from the compiled program's dots and from the convolutions the TPU
compiler writes dots as (per device, after partitioning), in every computation, and
attributed to the piece (entry or loop body, costs.Costs.owner) that runs them.
"""

from __future__ import annotations

import collections
import math
import re

from shardax.sharding import hlo_text as hlo_text_lib
from shardax.perf import ops

_DOT = re.compile(r"\s(dot|convolution)\(([^)]*)\)")
_DIMS = {k: re.compile(k + r"=\{([\d,]*)\}") for k in
         ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims", "rhs_batch_dims")}
_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{size=[^}]*\}")
TILES = (128, 256)


def _pad(x: int, tile: int) -> int:
  return -(-x // tile) * tile


def utilization(m: int, k: int, n: int, tile: int) -> float:
  """Share of a tile x tile array's multiply-adds that do work for an [m, k] x [k, n] dot."""
  if tile <= 1 or min(m, k, n) <= 0:
    return 1.0
  return k / _pad(k, tile) * max(n / _pad(n, tile), m / _pad(m, tile))


def _ints(line: str, key: str) -> list[int]:
  found = _DIMS[key].search(line)
  return [int(d) for d in found.group(1).split(",") if d] if found else []


def dot_shape(line: str, shapes: dict[str, str]) -> tuple[int, int, int, float] | None:
  """(M, K, N, FLOPs) of a dot or dot-like convolution line; batch dims are repeats, not tile dims."""
  found = _DOT.search(line)
  if not found or "=" not in line:
    return None
  names = [o.strip().lstrip("%") for o in found.group(2).split(",")]
  operands = ops._shapes(found.group(2)) or [s[0] for n in names if (s := ops._shapes(shapes.get(n, "")))]
  if len(operands) < 2:
    return None
  lhs, rhs = operands[0][1], operands[1][1]
  if found.group(1) == "dot":
    lc, rc = _ints(line, "lhs_contracting_dims"), _ints(line, "rhs_contracting_dims")
    lb, rb = _ints(line, "lhs_batch_dims"), _ints(line, "rhs_batch_dims")
    k = math.prod(lhs[d] for d in lc)
    m = math.prod(v for d, v in enumerate(lhs) if d not in lc + lb)
    n = math.prod(v for d, v in enumerate(rhs) if d not in rc + rb)
    batch = math.prod(lhs[d] for d in lb)
    return m, k, n, 2.0 * batch * m * k * n
  labels = _LABELS.search(line)
  if not labels:
    return None
  lhs_l, rhs_l, _ = labels.groups()
  k, n = rhs[rhs_l.index("i")], rhs[rhs_l.index("o")]
  m_rows = math.prod(v for d, v in enumerate(lhs) if lhs_l[d] not in "f")   # batch and spatial positions
  flops = 2.0 * m_rows * k * n
  # A dot the compiler rewrote with a window: an unpadded window dim splits the contraction
  # (64 features x 2 taps for a 128-deep dot; the taps accumulate into the same outputs, so the
  # array sees i x taps), while a padded one is a batch-like dim written as a diagonal (the
  # heads of attention: one real tap per output), which adds no depth.
  # Strided or dilated window dims are diagonals too (attention's heads and kv groups: the
  # compiled 'bqkgd,bskd->bkgqs' is a window of 4 x 32 taps with stride 3x31 and lhs_dilate 4x32
  # over a 128-deep contraction).
  if window := _WINDOW.search(line):
    attrs = dict(f.split("=", 1) for f in window.group(0)[len("window={"):-1].split() if "=" in f)
    sizes = [int(v) for v in attrs["size"].split("x")]
    plain = lambda key, one: attrs.get(key, "x".join([one] * len(sizes))).split("x")
    k *= math.prod(size for size, pad, stride, ld, rd in zip(sizes, plain("pad", "0_0"), plain("stride", "1"),
                                                            plain("lhs_dilate", "1"), plain("rhs_dilate", "1"))
                   if (pad, stride, ld, rd) == ("0_0", "1", "1", "1"))
  return m_rows, k, n, flops


def by_piece(hlo_text: str, owner: dict[str, str], tiles=TILES) -> dict[str, dict[int, float]]:
  """{piece computation: {tile: FLOP-weighted utilization of its dots}} (pieces without dots omitted)."""
  blocks = hlo_text_lib.split(hlo_text).blocks
  shapes = ops.result_shapes(hlo_text.splitlines())
  flops = collections.Counter()
  useful = {t: collections.Counter() for t in tiles}
  for name, lines in blocks.items():
    piece = owner.get(name)
    if piece is None:
      continue
    for line in lines:
      if (shape := dot_shape(line, shapes)) is None or not shape[3]:
        continue
      m, k, n, f = shape
      flops[piece] += f
      for t in tiles:
        useful[t][piece] += f / utilization(m, k, n, t)   # the time-equivalent FLOPs the array spends
  return {p: {t: flops[p] / useful[t][p] for t in tiles} for p in flops if flops[p]}


def piece_utilization(mxu: dict | None, piece: str, tile: int) -> float:
  """A piece's utilization on a `tile` MXU from `by_piece` output (JSON keys are strings); 1 when
  the program's shapes were not read (a cache compiled before this) or the chip has no MXU."""
  if not mxu or tile <= 1 or piece not in mxu:
    return 1.0
  per_tile = mxu[piece]
  return float(per_tile.get(tile, per_tile.get(str(tile), 1.0)))
