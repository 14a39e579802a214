"""Published training runs rebuilt as shardax experiments, to check the step-time model.

`from_row(row)` turns one row of a published-runs table (the schema of
`published-runs/calibration.json`: hardware, model, training, sharding) into an
experiment config for the same model, batch, mesh, remat and dtypes on the same TPU
topology. Where shardax cannot say what the original ran, `approximations(row)`
lists what it does instead; docs/scale.md shows them next to each row:

  * positions: RoPE stands in for T5 relative position biases (a [heads, S, S] bias
    add per layer: no matmul, a little memory traffic);
  * attention: XLA's dot-product attention computes every score; the MaxText v5p and
    GPU rows used flash kernels that skip the masked half (a few % of their FLOPs);
  * remat: MaxText "minimal" / "minimal_flash" (save the projections, recompute
    attention scores) is shardax's dots_no_batch; Lingvo's default is taken as full;
  * optimizer: AdamW everywhere (Lingvo used factored Adafactor: less state and
    update traffic; the update is a small part of a step);
  * GPU rows: there is no GPU compiler for a machine we do not have, so the program
    is compiled for a TPU v5p topology with the same devices per node (8 per VM as
    one 2x2x2 slice, VMs as slices) and timed with the H100 figures: same
    partitioning and collectives, the TPU compiler's fusion and scheduling choices.
"""

from __future__ import annotations

import math

from shardax.configs import experiment

_GEN = {"TPU v3": "v3", "TPU v4": "v4", "TPU v5p": "v5p", "TPU v5e": "v5e", "TPU v6e": "v6e"}
_REMAT = {"full": "full", "minimal": "dots_no_batch", "minimal_flash": "dots_no_batch"}


def is_gpu(row: dict) -> bool:
  return "H100" in row["hardware"]["accelerator"] or "A100" in row["hardware"]["accelerator"]


def topology(row: dict) -> tuple[str, int]:
  """(topology name of one slice, number of slices) to compile the row for."""
  hw = row["hardware"]
  if is_gpu(row):
    return "v5p:2x2x2", max(1, hw["total_chips"] // 8)
  gen = _GEN[hw["accelerator"].split(" (")[0]]
  chips = hw["chips_per_slice"]
  if gen in ("v3", "v5e", "v6e"):
    side = math.isqrt(chips)
    return f"{gen}:{side}x{chips // side}", hw["num_slices"]
  dims = [4, 4, 4]
  for f in _factors(chips // 64):
    dims[dims.index(min(dims))] *= f
  return f"{gen}:{'x'.join(map(str, sorted(dims)))}", hw["num_slices"]


def _factors(n: int) -> list[int]:
  out, p = [], 2
  while n > 1:
    while n % p == 0:
      out.append(p)
      n //= p
    p += 1
  return sorted(out, reverse=True)


def remat(row: dict) -> str:
  policy = row["training"]["remat_policy"].split(" ")[0]
  return _REMAT.get(policy, "full")


def from_row(row: dict, num_layers: int | None = None):
  """The experiment config of a published run (optionally with fewer layers)."""
  m, t, sh = row["model"], row["training"], row["sharding"]
  cfg = experiment(name=f"calibration.{row['id']}")
  mc = cfg.model
  mc.num_layers = num_layers or m["num_layers"]
  mc.d_model, mc.num_heads, mc.d_ff = m["d_model"], m["num_heads"], m["d_ff"]
  mc.num_kv_heads, mc.head_dim = m.get("num_kv_heads"), m.get("head_dim")
  mc.vocab_size, mc.tied_embedding = m["vocab_size"], bool(m["tied_embeddings"])
  mc.mlp = "gated" if m["gated_mlp"] else "plain"
  act = m["activation"].lower()
  mc.activation = "silu" if "silu" in act else "gelu" if "gelu" in act else "relu"
  mc.parallel_block = "parallel" in m.get("block", "")
  mc.max_len = t["seq_len"]
  mc.dtype, mc.param_dtype = "bfloat16", "float32"
  mc.remat, mc.scan_layers = remat(row), True
  cfg.data.source, cfg.data.seq_len = "synthetic", t["seq_len"]
  cfg.train.global_batch = t["global_batch_seqs"]
  name, slices = topology(row)
  cfg.mesh.topology = name
  if "mesh_shape" in sh["ici"]:                       # Lingvo: 2D [s0, s1] over all cores
    cfg.mesh.axes, cfg.mesh.ici = ("data", "model"), tuple(sh["ici"]["mesh_shape"])
    cfg.sharding.preset = "2d"
  else:                                               # MaxText: data x fsdp x tensor
    ici, dcn = sh["ici"], sh.get("dcn") or {}
    cfg.mesh.axes = ("data", "fsdp", "model")
    cfg.mesh.ici = (ici["data"], ici["fsdp"], ici["tensor"])
    if slices > 1:
      cfg.mesh.dcn = (dcn.get("data", 1), dcn.get("fsdp", 1), dcn.get("tensor", 1))
    cfg.sharding.preset = "dp_fsdp_tp"
  return cfg


def approximations(row: dict) -> list[str]:
  """What the shardax rebuild does differently from the published run."""
  m, t = row["model"], row["training"]
  out = []
  if "relative" in m["position_encoding"].lower():
    out.append("RoPE for relative bias")
  kernel = t["attention_kernel"].lower()
  if ("flash" in kernel or "fused" in kernel) and "no flash" not in kernel:
    out.append("XLA attention for flash")
  if remat(row) != t["remat_policy"].split(" ")[0]:
    out.append(f"remat {remat(row)} for {t['remat_policy'].split(' (')[0]}")
  if "adafactor" in t["optimizer"].lower():
    out.append("AdamW for Adafactor")
  if is_gpu(row):
    out.append("TPU program, H100 timing")
  if not t.get("scan_layers", True):
    out.append("scanned for unrolled")
  return out


def published_step_seconds(row: dict) -> float:
  """The row's step time: published, or derived from its figures under its own FLOP convention
  (for MaxText v5p, the non-causal attention count its notes call most likely)."""
  if row["published"].get("step_time_s"):
    return float(row["published"]["step_time_s"])
  d = row["derived"]
  return float(d.get("step_time_s") or d["step_time_s_if_noncausal"])
