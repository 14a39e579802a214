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
The step model's `matmul_efficiency` (0.8, perf/hardware.py) is what large matmuls reach when
nothing pads (every dim a multiple of 128 on a 128 MXU, as in the rows it was set
against); a piece of the program runs at that times its dots' FLOP-weighted
utilization (`by_piece`). GPUs have no weight-stationary array (tensor cores take small
fragments, the GEMM kernel picks its tiles): their utilization is taken as 1.

Shapes and FLOPs are read from the compiled program's dots and from the convolutions the
TPU compiler writes dots as (per device, after partitioning; perf/hlo/matmuls.py), in
every computation, and attributed to the piece (entry or loop body, costs.Costs.owner)
that runs them.
"""

from __future__ import annotations

import collections

from shardax.perf import hlo
from shardax.perf.hlo import matmuls

TILES = (128, 256)


def _pad(x: int, tile: int) -> int:
  return -(-x // tile) * tile


def utilization(m: int, k: int, n: int, tile: int) -> float:
  """Share of a tile x tile array's multiply-adds that do work for an [m, k] x [k, n] dot."""
  if tile <= 1 or min(m, k, n) <= 0:
    return 1.0
  return k / _pad(k, tile) * max(n / _pad(n, tile), m / _pad(m, tile))


def by_piece(hlo_text: str, owner: dict[str, str], tiles=TILES) -> dict[str, dict[int, float]]:
  """{piece computation: {tile: FLOP-weighted utilization of its dots}} (pieces without dots omitted)."""
  mod = hlo.parse(hlo_text)
  flops = collections.Counter()
  useful = {t: collections.Counter() for t in tiles}
  for name, comp in mod.computations.items():
    piece = owner.get(name)
    if piece is None:
      continue
    for mm in matmuls.matmuls(mod, comp.instructions):
      if not mm.flops:
        continue
      (m, k, n), f = mm.mnk, mm.flops
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


def flash_kernel_fill(exp, tile: int) -> float:
  """The FLOP-weighted share of a `tile` x `tile` MXU the splash kernel's matmuls use (the rule
  above, on the shapes the kernel multiplies: blocks of bq queries and bkv keys, a query/key head
  width dk and a value width dv). Forward: S = Q K^T [bq, dk] x [dk, bkv] and P V [bq, bkv] x
  [bkv, dv]; backward (fused): S again, dP = dO V^T [bq, dv] x [dv, bkv], dV = P^T dO, dQ = dS K,
  dK = dS^T Q (contracting over a block). Only S and dP contract over a head width; with dk =
  dv = 128 on a 256 MXU they run at half rate: 2/3 of the forward's peak, 5/7 of the backward's.
  1 on a chip without an MXU (tile 0: GPUs) or where every width and block fills it."""
  if tile <= 1:
    return 1.0
  from shardax.layers import flash
  t, seq = exp.model, exp.data.seq_len
  m = getattr(t, "mla", None)
  dk, dv = (t.dim_per_head, t.dim_per_head) if m is None else (m.qk_head_dim, m.v_head_dim)
  bq, bkv = (flash._block(getattr(t, f"flash_block_{b}", 512), seq) for b in ("q", "kv"))
  forward = [(bq, dk, bkv), (bq, bkv, dv)]
  backward = [(bq, dk, bkv), (bq, dv, bkv), (bkv, bq, dv), (bq, bkv, dk), (bkv, bq, dk)]
  shapes = forward * (1 + (t.remat != "none")) + backward
  flops = [m_ * k * n for m_, k, n in shapes]
  spent = [f / utilization(*shape, tile) for f, shape in zip(flops, shapes)]
  return sum(flops) / sum(spent)
