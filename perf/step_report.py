"""How a step prediction (perf/stepmodel.py `Prediction`) reads in the dry run's printed report:
the step and its error bar, MFU and HFU, the breakdown, and the collectives by kind, mesh axis
and link."""

from __future__ import annotations

from shardax.perf import error_bar, hardware


def stand_in_line(pr) -> str:
  return (f"STAND-IN: this program was compiled for {pr.stand_in_for} and is priced as {pr.chip}; "
          f"the partitioning and collectives are real, the fusion and scheduling are {pr.stand_in_for}'s")


def format_prediction(pr) -> list[str]:
  """Lines for the dry run's printed report."""
  b, c = pr.breakdown, pr.breakdown["collectives"]
  lines = [stand_in_line(pr)] if pr.stand_in_for else []
  lines += [f"  predicted step ({pr.chip}, matmuls at {b['matmul_efficiency']:.0%} of peak): "
           f"{pr.step_seconds:.4g} s, {pr.tokens_per_second_per_device:,.1f} tokens/s/device",
           "  " + error_bar.for_chip(hardware.CHIPS[pr.chip])["line"] if pr.chip in hardware.CHIPS else "",
           f"    MFU {pr.mfu:.1%} (model FLOPs: {pr.flops_convention}); HFU {pr.hfu:.1%} "
           f"(compiled FLOPs, recompute x{b['recompute_factor'] or 0:.2f} of model)",
           f"    compute {b['compute_seconds']:.4g} s, memory {b['memory_seconds']:.4g} s"
           + (f" ({b['matmul_free_seconds']:.4g} s of it in kernels without a matmul, which a GPU runs alone)"
              if b.get("matmul_free_seconds") else "") + ", "
           f"collectives exposed {c['exposed_seconds']:.4g} s / hidden {c['hidden_seconds']:.4g} s, "
           f"bubble {b['bubble_seconds']:.4g} s"]
  if (r := b.get("roofline")) and r["seconds"]:
    lines.append(f"    roofline {r['seconds']:.4g} s (model FLOPs at peak {r['model_flops_seconds']:.4g} s, "
                 f"HBM floor {r['hbm_floor_seconds']:.4g} s): the step is {pr.step_seconds / r['seconds']:.2f}x it")
  lines = [l for l in lines if l]
  if b.get("mxu_utilization", 1.0) < 0.995:
    lines.append(f"    MXU tiles: the program's dot shapes use {b['mxu_utilization']:.0%} of the matrix units' "
                 f"multiply-adds (padding to the MXU side; perf/mxu.py)")
  for dtype, e in sorted(b.get("eight_bit_flops", {}).items()):
    lines.append(f"    8-bit dots: {e['flops']:.4g} FLOPs per device on {dtype} operands, priced at "
                 f"{e['peak'] / 1e12:,.0f} T/s peak")
  if c["by_kind"]:
    lines.append("    collectives by kind: " + ", ".join(f"{k} {v:.3g} s" for k, v in sorted(c["by_kind"].items())))
    lines.append("    collectives by mesh axis: " + ", ".join(f"{k} {v:.3g} s" for k, v in sorted(c["by_axis"].items())))
    dcn = (f" (DCN priced at {b['dcn_bandwidth'] / 1e9:g} GB/s one way per device)"
           if c["by_link"].get("dcn") and b.get("dcn_bandwidth") else "")
    lines.append("    collectives by link: " + ", ".join(f"{k} {v:.3g} s" for k, v in sorted(c["by_link"].items()))
                 + dcn)
  return lines
