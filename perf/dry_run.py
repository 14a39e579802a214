"""`--mode=dry_run`: will this experiment fit, and how fast could it go, on a pod we do not have?

With `--set mesh.topology=v4:8x16x16` the mesh is built over the TPU devices libtpu
describes for that slice (sharding/topology.py), and the real train step is compiled
for it from abstract shapes: nothing is allocated, nothing runs. The TPU compiler's
own memory analysis then says how many bytes each chip needs; the HLO says what it
communicates. Without a topology the dry run compiles for this process's devices.

The report (`dry_run.json` in the job dir, and a table on stdout):
  bytes_per_device  params and optimizer_state from the shardings (exact, unpadded);
                    argument/output/alias/temp from the compiler; total = argument +
                    output - alias (donated) + temp: the program's peak.
  fits              total <= hbm_bytes_per_device: the HBM the TPU compiler lets a program
                    use (`usable_hbm_bytes`: v6e 31.25 GiB of its 32, v5e 15.48 of 16),
                    else the chip table's capacity (perf/hardware.py). If the TPU
                    compiler itself refuses (RESOURCE_EXHAUSTED), total is the figure
                    from its message.
  flops_per_device  FLOPs of the compiled step per device with every loop body times its
                    trip count (perf/costs.py); flops_loop_bodies_once is XLA's
                    own figure, which counts a scanned layer once.
  bytes_accessed_per_device  the same for memory traffic (logical bytes).
  model_flops_per_step  the model's formula (`flops_per_example(data) x global_batch`;
                    for the LM: 6N + causal-halved attention, perf/flops.py);
                    flops_convention says so.
  buffers           the largest blocks of the program's device (HBM) and host temp memory,
                    each named by the value that needs it (size, shape, dtype, HLO
                    instruction, op_name, source line), read from XLA's buffer assignment
                    (perf/buffers.py); also when the compiler refuses the program.
  collectives       per kind: count and bytes per step, loops unrolled.
  balance_bet       for an MoE whose token copies past a finite capacity or expert buffer
                    are dropped (or stop the run): that bound and the field that changes it
                    (trainer/moe_drops.py `bet`); None when no routing can overflow.
  balance_bet_measured  what that bet dropped over a small run from step 0
                    (perf/measured_drops.py, benchmarks/moe_drops.py); None when not measured.
  predicted         the step-time model (perf/stepmodel.py, assumptions in its
                    docstring): step_seconds, mfu (model FLOPs), hfu (compiled FLOPs),
                    tokens_per_second_per_device, and a breakdown into compute, memory,
                    collectives by kind / mesh axis / link, exposed vs hidden, bubble, and
                    the roofline it is checked against. None when the chip is not in
                    perf/hardware.py (e.g. CPU), or when the prediction is refused.
  prediction_refused  None, or why the step model's figure was refused: a step under the
                    roofline (model FLOPs at the chips' peak, the HBM floor: stepmodel.roofline)
                    cannot be true; message, the refused step_seconds and the bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
import time
from typing import Any

import jax
import numpy as np

from shardax.configs.schema import Experiment
from shardax.sharding import make_mesh, networks, report, use_rules
from shardax.trainer import jobdir, moe_drops
from shardax.perf import buffers as buffers_lib, hardware, costs as costs_lib, levers, measured_drops, mxu as mxu_lib
from shardax.perf import step_report, stepmodel
from shardax.perf.flops import CONVENTION
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM_SIZES = re.compile(r"([\d.]+)\s*([KMGT]?)i?B?\b")


def prepare(exp: Experiment):
  """(mesh, setup) for the experiment, on `mesh.topology` when set."""
  mesh = make_mesh(exp.mesh)
  return mesh, state_lib.create(exp, mesh)


def compile_step(setup):
  """The compiled train step (AOT, from abstract shapes) under the experiment's mesh and rules."""
  return _compile(setup, None)[0]


def _compile(setup, dump_dir: str | None):
  """(compiled step or, with `dump_dir`, the compiler's RESOURCE_EXHAUSTED error; the lowered
  program's text). With `dump_dir` XLA also writes its buffer assignment there (buffers.py)."""
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, setup.exp.sharding.allow_uneven):
    if dump_dir is None:
      return step_lib.compile_train_step(setup), None
    lowered = step_lib.lower_train_step(setup)
    text = lowered.as_text()
    try:
      return lowered.compile(compiler_options=buffers_lib.dump_options(dump_dir)), text
    except Exception as e:  # the TPU compiler refuses programs that exceed HBM
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return e, text


def compile_with_buffers(setup, top: int = 12):
  """(compiled step or the compiler's RESOURCE_EXHAUSTED error, its largest temp buffers):
  the buffer list is read also when the compiler refuses the program for its size. A step read
  back from the persistent compilation cache writes no dump: its list is the one kept beside
  the cache when it was compiled (buffers.remembered, keyed by the lowered program)."""
  with tempfile.TemporaryDirectory(prefix="shardax-buffers-") as dump:
    compiled, program = _compile(setup, dump)
    return compiled, buffers_lib.remembered(dump, top, program)


def _shard_bytes(abstract: Any) -> int:
  total = 0
  for leaf in jax.tree.leaves(abstract):
    local = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += math.prod(local) * np.dtype(leaf.dtype).itemsize
  return total


def _parse_oom(message: str) -> tuple[int | None, int | None]:
  """(required, available) bytes from the TPU compiler's RESOURCE_EXHAUSTED message."""
  sizes = [int(float(v) * _UNITS[u]) for v, u in _OOM_SIZES.findall(message) if u]
  if len(sizes) < 2:
    return None, None
  return sizes[0], sizes[1]


def hint(mem: dict, hbm: int | None, exp: Experiment | None = None, buffers: list | None = None) -> str:
  """What to try when the program does not fit: with the buffer list, the unused levers
  ranked by the bytes each frees (perf/levers.py); else the general advice."""
  state = (mem.get("params") or 0) + (mem.get("optimizer_state") or 0)
  where = "weights and optimizer state" if hbm and state > hbm / 2 else "activations (temp)"
  if exp is not None and buffers and (ranked := levers.rank(exp, mem, buffers)):
    short = f" (short by {_gib(mem['total'] - hbm)})" if hbm and mem.get("total") else ""
    return f"most memory goes to {where}{short}. " + levers.hint(ranked)
  return (f"most memory goes to {where}. Try: shard weights over more devices "
          f"(sharding.preset=fsdp or 2d, a larger -1 axis in mesh.ici), rematerialize "
          f"(model.remat=full), split the batch (train.microbatches=N), bf16 params "
          f"(model.param_dtype=bfloat16), or pipeline stages (model.pipeline.stages=N)")


def dry_run(exp: Experiment, job_dir: str | None = None, costs_out: list | None = None) -> dict:
  """Compile the train step for the experiment's mesh and report memory, FLOPs, comms, roofline
  (`costs_out`: a list that receives the program's loop-aware costs, for extrapolate.py)."""
  mesh, setup = prepare(exp)
  kind = mesh.devices.flat[0].device_kind
  chip = hardware.lookup(kind, exp.mesh.network)
  mem = {"params": _shard_bytes(setup.abstract["params"]),
         "optimizer_state": _shard_bytes(setup.abstract["opt_state"])}
  model_flops = float(exp.model.flops_per_example(exp.data)) * exp.train.global_batch
  out: dict[str, Any] = {
      "experiment": exp.name, "topology": exp.mesh.topology, "device_kind": kind,
      "num_devices": int(mesh.size), "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "rules": [list(r) for r in setup.rules], "num_params": state_lib.count_params(setup),
      "global_batch": exp.train.global_batch, "tokens_per_step":
          exp.model.tokens_per_example(exp.data) * exp.train.global_batch,
      "hbm_bytes_per_device": usable_hbm_bytes(mesh, chip) or (chip.hbm_bytes if chip else None),
      "balance_bet": moe_drops.bet(exp, dict(mesh.shape), setup.rules), "error": None}
  out["balance_bet_measured"] = out["balance_bet"] and measured_drops.line(getattr(exp.model, "moe", None))
  start, cpu_start = time.perf_counter(), time.process_time()
  compiled, buffers = compile_with_buffers(setup, top=24)  # the report prints 12 of each space
  out["buffers"] = [dataclasses.asdict(b) for b in buffers]
  if isinstance(compiled, Exception):
    e = compiled
    required, available = _parse_oom(str(e))
    out["compile_seconds"] = time.perf_counter() - start
    out["compile_cpu_seconds"] = time.process_time() - cpu_start
    out["hbm_bytes_per_device"] = available or out["hbm_bytes_per_device"]
    mem.update(temp=None, total=required)
    out.update(bytes_per_device=mem, fits=False, flops_per_device=None,
               flops_loop_bodies_once=None, bytes_accessed_per_device=None,
               model_flops_per_step=model_flops, flops_convention=CONVENTION, collectives={},
               predicted=None, prediction_refused=None, error=str(e).splitlines()[0])
    out["hint"] = hint(mem, out["hbm_bytes_per_device"], exp, out["buffers"])
    return write(out, job_dir)
  out["compile_seconds"] = time.perf_counter() - start
  out["compile_cpu_seconds"] = time.process_time() - cpu_start  # all threads; robust to a busy host
  analysis = report.memory(compiled)
  mem.update(temp=analysis.get("temp_bytes"), total=analysis.get("peak_estimate_bytes"),
             **{k.removesuffix("_bytes"): v for k, v in analysis.items()
                if k in ("argument_bytes", "output_bytes", "alias_bytes", "generated_code_bytes")})
  mem["host_temp"] = host_temp_bytes(compiled)
  hbm = out["hbm_bytes_per_device"]
  fits = None if hbm is None or mem["total"] is None else bool(mem["total"] <= hbm)
  hlo = compiled.as_text()
  cost = costs_lib.of_hlo_text(hlo)
  if costs_out is not None:
    costs_out.append(cost)
  mxu = mxu_lib.by_piece(hlo, cost.owner)   # the dots' padding to each MXU tile, per piece
  out.update(bytes_per_device=mem, fits=fits, flops_per_device=cost.flops,
             flops_loop_bodies_once=cost.flops_loop_bodies_once,
             bytes_accessed_per_device=cost.bytes_accessed,
             model_flops_per_step=model_flops, flops_convention=CONVENTION,
             collectives=report.collective_summary(hlo),
             hint=None if fits is not False else hint(mem, hbm, exp, out["buffers"]))
  predicted = price(out, cost, mesh, exp, chip, mxu, stepmodel.runs_flash_kernel(hlo))
  if predicted:  # offloaded activations (model.remat='offload*'): their host transfers
    out["predicted"]["breakdown"]["offload"] = stepmodel.offload_seconds(
        mem["host_temp"], predicted.breakdown["compute_seconds"], chip)
  if exp.mesh.dcn:  # several granules: which collectives stay on ICI, which cross DCN
    out["networks"] = networks.split_by_network(hlo, mesh, report.collectives(hlo))
  return write(out, job_dir)


def price(out: dict, cost, mesh, exp: Experiment, chip, mxu: dict | None, flash_kernel: bool):
  """The step model's prediction for the report `out` (its bytes_per_device already set):
  out['predicted'] (brief, with the MXU read per piece for a depth extrapolation), or, when the
  step model refuses a step under the roofline (stepmodel.ImpossiblePrediction), predicted None
  and out['prediction_refused'] (message, the refused step, the bound). Returns the Prediction
  or None (refused, or no chip row)."""
  out["predicted"], out["prediction_refused"] = None, None
  if chip is None:
    return None
  mem = out["bytes_per_device"]
  state = (mem.get("params") or 0) + (mem.get("optimizer_state") or 0) or None
  try:
    predicted = stepmodel.from_costs(cost, mesh, exp, chip, mxu, flash_kernel=flash_kernel,
                                     state_bytes_per_device=state)
  except stepmodel.ImpossiblePrediction as e:
    out["prediction_refused"] = e.as_dict()
    return None
  out["predicted"] = _brief(predicted.as_dict())
  out["predicted"]["breakdown"]["mxu_by_piece"] = {  # JSON keys
      p: {str(t): u for t, u in v.items()} for p, v in (mxu or {}).items()}
  return predicted


_USABLE_HBM: dict[str, int | None] = {}


def usable_hbm_bytes(mesh, chip) -> int | None:
  """The HBM the TPU compiler lets one program use, per device, or None (not a TPU, or no
  figure). The compiler keeps part of the chip's capacity (v6e: 31.25 of 32 GiB; v5e:
  15.48 of 16), so a peak between the two compiles on paper and is refused by the compiler:
  the chip table's figure would call it a fit. Found by compiling a probe whose argument is
  twice the chip's HBM and reading "available HBM (...)" from the refusal (~1 s, once per
  device kind), rather than hard-coding the reservation, which differs by generation."""
  device = mesh.devices.flat[0]
  if getattr(device, "platform", None) != "tpu":
    return None
  kind = device.device_kind
  if kind not in _USABLE_HBM:
    cols = 2**20
    rows = 2 * (chip.hbm_bytes if chip else 2**40) // (4 * cols)
    one = jax.sharding.Mesh(np.array([device]), ("probe",))
    x = jax.ShapeDtypeStruct((rows, cols), np.float32,
                             sharding=jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec()))
    try:
      jax.jit(lambda x: x[:8] + 1).lower(x).compile()
      _USABLE_HBM[kind] = None
    except Exception as e:  # the expected refusal; anything else: no figure
      _USABLE_HBM[kind] = _parse_oom(str(e))[1] if "RESOURCE_EXHAUSTED" in str(e) else None
  return _USABLE_HBM[kind]


def host_temp_bytes(compiled) -> int:
  """Bytes per device the program keeps in host memory (offloaded activations), else 0."""
  m = compiled.memory_analysis()
  return int(getattr(m, "host_temp_size_in_bytes", 0) or 0) if m is not None else 0


def _brief(p: dict) -> dict:
  """The prediction for dry_run.json, without the per-piece table."""
  p = dict(p, breakdown={k: v for k, v in p["breakdown"].items() if k != "pieces"})
  return p


def write(out: dict, job_dir: str | None) -> dict:
  """The report as job_dir/dry_run.json (a local dir or an object store); returns it."""
  if job_dir:
    jobdir.write_text(jobdir.path(job_dir) / "dry_run.json", json.dumps(out, indent=2))
  return out


def _gib(b: int | None) -> str:
  if b is None:
    return "?"
  unit = next(u for u in ("GiB", "MiB", "KiB", "B") if b >= _UNITS.get(u[0], 1) or u == "B")
  return f"{b / _UNITS.get(unit[0], 1):,.2f} {unit}"


def format_report(r: dict) -> str:
  """The human-readable table printed by `--mode=dry_run`."""
  m = r["bytes_per_device"]
  fits = {True: "yes", False: "NO", None: "unknown (" + (
      "see below" if r.get("memory_unknown") else "no chip table entry") + ")"}[r["fits"]]
  stand_in = (r.get("predicted") or {}).get("stand_in_for")
  lines = [step_report.stand_in_line(stepmodel.Prediction(**r["predicted"]))] if stand_in else []
  lines += [f"dry run of {r['experiment']} on {r['topology'] or 'local devices'} "
           f"({r['num_devices']} x {r['device_kind']}), mesh {r['mesh']}",
           f"  params {r['num_params']:,}, global batch {r['global_batch']} "
           f"({r['tokens_per_step']:,} tokens), compile {r['compile_seconds']:.1f} s "
           f"({r['compile_cpu_seconds']:.1f} s CPU)",
           "  per-device memory:"]
  for key in ("params", "optimizer_state", "temp", "total"):
    lines.append(f"    {key:<16}{_gib(m.get(key)):>16}")
  if m.get("host_temp"):
    lines.append(f"    {'host (offload)':<16}{_gib(m['host_temp']):>16}   (host memory, not HBM)")
  chip = hardware.lookup(r["device_kind"])
  usable = (f" (what the compiler allows of the chip's {_gib(chip.hbm_bytes)})"
            if chip and r["hbm_bytes_per_device"] not in (None, chip.hbm_bytes) else "")
  lines.append(f"    {'hbm':<16}{_gib(r['hbm_bytes_per_device']):>16}   fits: {fits}{usable}")
  if r.get("memory_unknown"):
    lines.append(f"  memory unknown: {r['memory_unknown']}")
  if r["error"]:
    lines.append(f"  compiler: {r['error']}")
  if r.get("balance_bet"):
    lines.append(f"  {r['balance_bet']}")
  if r.get("balance_bet_measured"):
    lines.append(f"  {r['balance_bet_measured']}")
  copy = (r.get("shallow") or {}).get("layers") if r.get("compile_path") == "shallow" else None
  lines += buffers_lib.format_table([buffers_lib.Buffer(**b) for b in r.get("buffers") or []],
                                    source=f"the {copy[-1]}-layer shallow copy" if copy else None)
  if r["flops_per_device"] is not None:
    lines.append(f"  FLOPs: hardware (compiled program, loops x trip count) {r['flops_per_device']:.4g} "
                 f"per device; model ({r['flops_convention']}) {r['model_flops_per_step']:.4g} per step")
  if r["collectives"]:
    lines.append(f"  {'collective':<20}{'count':>8}{'bytes':>22}")
    for kind, c in sorted(r["collectives"].items()):
      lines.append(f"  {kind:<20}{c['count']:>8,}{c['bytes']:>22,}")
  for net, rows in (r.get("networks") or {}).items():
    lines.append(f"  over {net.upper()}: " + (", ".join(
        f"{kind} x{c['count']:,} ({c['bytes']:,} bytes)" for kind, c in sorted(rows.items())) or "none"))
  if refused := r.get("prediction_refused"):
    lines.append(f"  PREDICTION REFUSED: {refused['message']}")
  if p := r.get("predicted"):
    lines.extend(step_report.format_prediction(stepmodel.Prediction(**p)))
    if kernel := p["breakdown"].get("flash_kernel_seconds"):
      lines.append(f"    flash attention kernel: {kernel:.4g} s of the step (its FLOPs priced from the model, "
                   f"XLA's costs count a Pallas call as 0; in HFU and the recompute factor)")
    if (off := p["breakdown"].get("offload")) and off["bytes"]:
      lines.append(f"    host offload: {_gib(off['bytes'])} out and back at {off['host_bandwidth'] / 1e9:.0f} GB/s "
                   f"= {off['seconds']:.3g} s per step, " + ("hidden under compute" if off["hidden"] else
                   f"{off['exposed_seconds']:.3g} s exposed (more than the step's compute)"))
  if r.get("hint"):
    lines.append(f"  hint: {r['hint']}")
  return "\n".join(lines)


def markdown_table(reports: list[dict]) -> str:
  """One row per dry run: what docs/scale.md shows (`python -m shardax.perf.dry_run J...`)."""
  rows = ["| experiment | topology (devices) | params | per-device total / HBM | fits | "
          "predicted step | predicted MFU | compile (CPU) |", "|---|---|---|---|---|---|---|---|"]
  for r in reports:
    m, pr = r["bytes_per_device"], r.get("predicted") or {}
    step = f"{pr['step_seconds']:.2f} s" if pr else "refused (under the roofline)" if r.get("prediction_refused") else "-"
    mfu = f"{pr['mfu']:.0%}" if pr else "-"
    fits = {True: "yes", False: "**no**", None: "?"}[r["fits"]]
    cpu = f"{r['compile_cpu_seconds']:.0f} s" if r.get("compile_cpu_seconds") else "-"
    rows.append(f"| {r['experiment']} | {r['topology']} ({r['num_devices']}) | {r['num_params'] / 1e9:,.1f}B | "
                f"{_gib(m['total'])} / {_gib(r['hbm_bytes_per_device'])} | {fits} | {step} | {mfu} | "
                f"{r['compile_seconds']:.0f} s ({cpu}) |")
  return "\n".join(rows)


if __name__ == "__main__":
  import sys
  print(markdown_table([json.load(open(p)) for p in sys.argv[1:]]))
