"""Dry runs of deep scanned models from two shallow copies, extrapolated to full depth.

Why it holds. With `scan_layers` the layer stack is one loop body run L times over
weights stacked [L, ...], so every per-device figure of a dry run is affine in the
depth, f(L) = f0 + L x f1:
  argument / output / alias bytes  params and optimizer state: the [L, ...] stacks plus
                                   the embedding, head and norms (exactly affine);
  temp bytes                       what the backward pass keeps per layer (the layer input
                                   under full remat, more under lighter policies) and the
                                   stacked weight gradients grow with L; one layer's working
                                   set and the head's logits do not;
  collectives                      those in the loop body run L times, the rest once;
  model FLOPs, params              the formula and the parameter count: affine by construction.
Two compiles at depths a < b give f(L) = f(a) + (f(b) - f(a)) (L - a) / (b - a) for the
memory figures. The time figures (FLOPs, bytes accessed, the step-time prediction) come
from the deeper copy's loop-aware costs deepened by `costs.deepen`, the one way a shallow
compile is deepened (the calibration uses it too): its layer loop runs L / b times as
often, what lies outside it scales with the parameter count; MFU and the ratios are
re-derived from the result (`_derive`).

The unit: a shallow copy must keep the model's structure, so depths are multiples of
  dense LM                        1 layer;
  pipeline (S stages, R repeats)  S x R layers: one layer per stage per visit, so the
                                  schedule (M x R + S - 1 iterations, its bubble, the
                                  circular queue) is unchanged; only the per-visit scan
                                  of L / (S x R) layers shortens;
  GShard MoE LM                   `moe.every` layers: (every - 1) dense blocks and one MoE
                                  block are one scanned unit (S x R of them when pipelined).
The copies have 3 and 4 units. Shallower ones mislead: on pod.lm_16b (v4:4x4x4) the
1-layer copy needs *more* temp than the 2-layer one (11.9 vs 9.3 GB: the compiler drops
the trip-1 loop and schedules the step differently), and the 2 -> 3 layer step is 1.5x
the per-layer step from 3 layers on. A scanned stack compiles in about the same time at
any depth, so deeper copies cost nothing extra.

Where it does not hold, the dry run compiles the full model and says why in
`compile_path_reason`: unscanned stacks (`scan_layers=False`: L copies of the block,
whose buffers the compiler may share or schedule differently at each depth), models of
at most 4 units (nothing to save), and by default: `--shallow` asks for this path,
because a scanned stack compiles in about the same time at any depth, so two shallow
compiles cost more than one full one (docs/scale.md). Near the HBM line the
extrapolation is an estimate of what the compiler would *need*: a program over its
budget makes the TPU compiler rematerialize harder, so a "does not fit" within a few
percent of HBM deserves a check with the full compile.

It can fail badly. The compiler's temporaries at a few layers need not be on the line
through the full depth's: on pod.lm_1t the copies of 3 and 4 layers extrapolate to
82 GiB of temp per core where the full compile needs 9.8 GiB (their difference, about
one layer's all-gathered weights, is not a per-layer cost of the deep program), while
on pod.lm_16b the same recipe lands within 3%; moe.deepseek_v3's 6- and 7-layer copies
grow 1.45 GB a MoE layer where the full program keeps 0.94 GB, so the extrapolation asked
109.9 GB a chip (does not fit) for a model that compiles whole in 72.0 GiB of 95.7. The
report keeps both copies' temp bytes (`shallow.temp_bytes`) so a reader can see the slope
it used; a shallow "does not fit" says it is an estimate to confirm without --shallow, and
a temp that falls with depth is reported unknown (`_refuse_falling_temp`).

Compile effort: `effort` (-1..1: jax 0.10's `exec_time_optimization_effort`, on jax 0.11
`jax_optimization_level` O0 for -1, see `_optimization_level`) trades the
compiled program's speed for compile time. The dry run keeps the default (0); the
planner uses -1, which compiles ~4-5x faster on this machine (the TPU backend's code
scheduling is most of a compile) and changes the compiler's memory plan: +0.7% temp on a
2-layer copy of pod.lm_1t, -11% total on pod.lm_16b (16.55 vs 18.55 GiB). Rank with
it; confirm the chosen layout at effort 0 (docs/scale.md, "Plan").
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from fractions import Fraction
from typing import Any, Iterator

import jax

from shardax.configs.schema import Experiment
from shardax.perf import hardware
from shardax.perf import dry_run as dry_run_lib
from shardax.perf import stepmodel

SHALLOW_UNITS = (3, 4)


@dataclasses.dataclass(frozen=True)
class Depth:
  """How deep the experiment's layer stack is, and in which steps it may be cut."""
  layers: int
  unit: int
  field: str  # the config path of the layer count, for messages
  offset: int = 0  # layers outside the repeating units (an MoE LM's first dense layers)


def depth(exp: Experiment) -> Depth | str:
  """The stack's Depth when shallow copies extrapolate to it, else the reason they do not."""
  model = exp.model
  t = model
  if not hasattr(t, "num_layers"):
    return f"{type(model).__name__} has no layer stack to cut"
  field = "model.num_layers"
  if not t.scan_layers:
    return ("model.scan_layers=False: an unrolled stack is not one loop body, so its "
            "per-layer memory need not be linear in depth")
  unit, offset = 1, 0
  if model.moe is not None:
    unit, offset = model.moe.every, model.moe.first_dense_layers
  if getattr(t, "layer_pattern", ()):   # whole units of lcm(pattern, every); the tail stays as it is
    unit, offset = t.layers_per_unit, offset + t.num_tail_layers
  if t.pipeline.stages > 1:   # one unit per stage per visit (an MoE unit in a pipelined MoE model)
    unit *= t.pipeline.stages * t.pipeline.circular_repeats
  if t.num_layers <= offset + SHALLOW_UNITS[-1] * unit:
    return (f"{field}={t.num_layers} is already as shallow as the copies "
            f"({offset + SHALLOW_UNITS[-1] * unit})")
  return Depth(t.num_layers, unit, field, offset)


def with_layers(exp: Experiment, layers: int) -> Experiment:
  """The experiment with `layers` layers and everything else unchanged."""
  model = exp.model
  model = dataclasses.replace(model, num_layers=layers)
  return dataclasses.replace(exp, model=model)


def _optimization_level(effort: float) -> str:
  """jax 0.11's XLA effort level for an effort in [-1, 1]: 0 keeps the compiler's default.

  jax 0.11 dropped `jax_exec_time_optimization_effort` for `jax_optimization_level` (O0
  fastest compile .. O3). Measured on a v5e:2x2 dry run of a 12-layer lm.tiny: O0 and O1
  give the memory plan and compile time that effort -1 gave on jax 0.10.2 (temp 20.56 vs
  20.63 MB, 1.5 vs 1.4 s), the default that of effort 0.
  """
  if effort == 0:
    return "UNKNOWN"
  return "O0" if effort <= -0.5 else "O1" if effort < 0 else "O2" if effort < 0.5 else "O3"


@contextlib.contextmanager
def compile_effort(effort: float) -> Iterator[None]:
  """Compile inside this block at `effort` (jax <= 0.10: exec_time_optimization_effort; 0.11: the level)."""
  if hasattr(jax.config, "jax_exec_time_optimization_effort"):
    key, value = "jax_exec_time_optimization_effort", float(effort)
  else:
    key, value = "jax_optimization_level", _optimization_level(effort)
  old = getattr(jax.config, key)
  jax.config.update(key, value)
  try:
    yield
  finally:
    jax.config.update(key, old)


def affine(a: Any, b: Any, xa: int, xb: int, x: int) -> Any:
  """f(x) from f(xa) = a and f(xb) = b, leaf by leaf (dicts by key; ints stay ints).

  Non-numbers come from `b`; a dict key only one side has counts as 0 on the other
  (e.g. a collective the trip-1 copy lost with its loop). Bytes and counts cannot go
  below zero, so negative results (compiler noise on a flat figure) clamp to 0.
  """
  if isinstance(a, dict) or isinstance(b, dict):
    a, b = a or {}, b or {}
    return {k: affine(a.get(k, _zero(b.get(k))), b.get(k, _zero(a.get(k))), xa, xb, x)
            for k in {**a, **b}}
  if not _number(a) or not _number(b):
    return b
  value = Fraction(a) + (Fraction(b) - Fraction(a)) * (x - xa) / (xb - xa)
  value = max(value, Fraction(0))
  return round(value) if isinstance(a, int) and isinstance(b, int) else float(value)


def _number(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _zero(v: Any) -> Any:
  if isinstance(v, dict):
    return {k: _zero(x) for k, x in v.items()}
  return 0 if _number(v) else v


LEVERS_NOT_RANKED = ("Levers not ranked: the buffer list is a shallow copy's; a dry run "
                     "without --shallow ranks them by the bytes each frees")
SHALLOW_ESTIMATE = ("by the shallow copies' extrapolation, an estimate that can overstate temp "
                    "by tens of GiB: confirm without --shallow before changing the layout. ")


def _derive(out: dict, exp: Experiment) -> dict:
  """Figures that are not affine in depth, recomputed from the extrapolated ones.

  The step-time model's step is a sum over program pieces of executions x seconds each
  (perf/stepmodel.py), and only the layer loop's executions grow with depth, so
  its seconds are affine in depth; the ratios built on them (MFU, HFU, tokens/s) are not.
  """
  mem, hbm = out["bytes_per_device"], out["hbm_bytes_per_device"]
  out["fits"] = None if hbm is None or mem.get("total") is None else bool(mem["total"] <= hbm)
  # The general advice, not the ranked levers (perf/levers.py): the buffer list is the
  # deeper shallow copy's, whose layer-stacked blocks have its depth, not the model's, and
  # whose bytes are not the full depth's.
  out["hint"] = None if out["fits"] is not False else (
      SHALLOW_ESTIMATE + dry_run_lib.hint(mem, hbm) + f". {LEVERS_NOT_RANKED}")
  chip, p = hardware.lookup(out["device_kind"]), out.get("predicted")
  if chip and p and p["step_seconds"]:
    step, n = p["step_seconds"], out["num_devices"]
    tokens = exp.model.tokens_per_example(exp.data) * exp.train.global_batch
    p["mfu"] = p["model_flops_per_step"] / (n * chip.peak_bf16_flops * step)
    p["hfu"] = p["hardware_flops_per_device"] / (chip.peak_bf16_flops * step)
    p["tokens_per_second_per_device"] = tokens / step / n
    p["breakdown"]["recompute_factor"] = stepmodel.recompute_factor(
        p["hardware_flops_per_device"], n, p["model_flops_per_step"])
  return out


def _shallow_report(exp: Experiment, layers: int, effort: float, costs_out: list | None = None) -> dict:
  with compile_effort(effort):
    return dry_run_lib.dry_run(with_layers(exp, layers), costs_out=costs_out)


def _deepened(out: dict, b: dict, costs_b, exp: Experiment, d: Depth, layers_b: int) -> dict:
  """The time figures of the full depth from the deeper copy's costs, by costs.deepen (the
  one way a shallow compile is deepened; the calibration uses it too): the layer loop runs
  L / layers_b times as often; outside it, per-parameter traffic scales with the parameter
  count. Memory stays affine (above): temporaries are not a per-loop cost."""
  from shardax.sharding import make_mesh
  from shardax.perf import costs as costs_lib
  scale = out["num_params"] / b["num_params"] if b.get("num_params") else 1.0
  # the layer loop runs once per unit after the first dense layers (their own loop, as deep
  # in the copy as in the model): its trip count is (layers - offset) / unit
  units = lambda layers: (layers - d.offset) // d.unit
  deep = costs_lib.deepen(costs_b, units(layers_b), units(d.layers), scale)
  chip = hardware.lookup(out["device_kind"])
  out.update(flops_per_device=deep.flops, bytes_accessed_per_device=deep.bytes_accessed)
  if chip is not None:
    brief = (b.get("predicted") or {}).get("breakdown") or {}
    # a shallow copy that ran the Pallas flash kernel (0 FLOPs in XLA's costs): the full
    # depth's kernel time, as the full compile's dry run adds it; refused under the roofline
    dry_run_lib.price(out, deep, make_mesh(exp.mesh), exp, chip, brief.get("mxu_by_piece"),
                      flash_kernel="flash_kernel_seconds" in brief)
  return out


def extrapolated(exp: Experiment, d: Depth, effort: float = 0.0) -> dict:
  """The dry-run report of `exp` from shallow copies of 1 and 2 units."""
  xa, xb = (d.offset + u * d.unit for u in SHALLOW_UNITS)
  dry_run_lib.prepare(exp)  # the full model's shardings: a mesh or rule error surfaces here
  costs_b: list = []
  a = _shallow_report(exp, xa, effort)
  b = _shallow_report(exp, xb, effort, costs_b)
  shallow = {"layers": [xa, xb], "field": d.field, "unit": d.unit, "effort": effort,
             "compile_seconds": [a["compile_seconds"], b["compile_seconds"]],
             "temp_bytes": [a["bytes_per_device"].get("temp"), b["bytes_per_device"].get("temp")]}
  if a["error"] or b["error"]:  # a shallow copy over HBM: the full model is too
    worst = b if b["error"] else a
    out = {**worst, "fits": False, "shallow": shallow, "compile_path": "shallow",
           "error": f"with only {shallow['layers'][worst is b]} layers: {worst['error']}",
           "compile_seconds": a["compile_seconds"] + b["compile_seconds"],
           "compile_cpu_seconds": a["compile_cpu_seconds"] + b["compile_cpu_seconds"]}
    return _with_exact(out, exp)
  out = affine(a, b, xa, xb, d.layers)  # memory; then the deepened times, the exact and derived fields
  _refuse_falling_temp(out, shallow)
  out = _deepened(out, b, costs_b[0], exp, d, xb)
  out.update(compile_seconds=a["compile_seconds"] + b["compile_seconds"],
             compile_cpu_seconds=a["compile_cpu_seconds"] + b["compile_cpu_seconds"],
             compile_path="shallow", shallow=shallow)
  return _derive(_with_exact(out, exp), exp)


TEMP_NOISE = 0.01  # a temp that falls by less between the copies is flat (compiler noise)


def _refuse_falling_temp(out: dict, shallow: dict) -> None:
  """Temp and total unknown when the deeper copy needs less temp than the shallower one.

  A deeper stack keeps at least as much for the backward pass, so temp falling with depth
  means the compiler planned the two copies differently, and the line through them says
  nothing about the full depth: extended to 61 layers it went below zero (moe.deepseek_v3
  with model.remat='full': 25.06 GB at 6 layers, 17.12 GB at 7), and a clamped 0 read as
  "fits: yes". The exactly affine figures (params, optimizer state) stay.
  """
  ta, tb = shallow["temp_bytes"]
  if ta is None or tb is None or tb >= ta * (1 - TEMP_NOISE):
    return
  xa, xb = shallow["layers"]
  out["bytes_per_device"].update(temp=None, total=None)
  out["memory_unknown"] = (f"temp fell with depth in the shallow copies ({ta / 2**30:.2f} GiB at "
                           f"{xa} layers, {tb / 2**30:.2f} GiB at {xb}): the full depth's memory "
                           f"cannot be extrapolated; run without --shallow to compile it")


def _with_exact(out: dict, exp: Experiment) -> dict:
  """Fields known from the full config without compiling it."""
  out.update(experiment=exp.name, global_batch=exp.train.global_batch,
             model_flops_per_step=float(exp.model.flops_per_example(exp.data)) * exp.train.global_batch,
             tokens_per_step=exp.model.tokens_per_example(exp.data) * exp.train.global_batch)
  return out


def dry_run(exp: Experiment, job_dir: str | None = None, *, full: bool = False,
            effort: float = 0.0) -> dict:
  """`--mode=dry_run`: shallow copies extrapolated when the stack allows, else the full compile.

  The report is the dry run's (perf/dry_run.py) plus `compile_path` ("shallow" or
  "full"), `compile_path_reason` (why not shallow) and, on the shallow path, `shallow`
  (the depths compiled and their compile seconds).
  """
  start = time.perf_counter()
  d = depth(exp)
  if full or isinstance(d, str):
    with compile_effort(effort):
      out = dry_run_lib.dry_run(exp)
    out.update(compile_path="full", compile_path_reason="the default; --shallow extrapolates from shallow copies" if full else d)
  else:
    out = extrapolated(exp, d, effort)
    out["compile_path_reason"] = None
  out["dry_run_seconds"] = time.perf_counter() - start
  out["compile_effort"] = effort
  return dry_run_lib.write(out, job_dir)


def format_path(r: dict) -> str:
  """One line for the printed report: which compile produced the figures."""
  if r.get("compile_path") == "shallow":
    s = r["shallow"]
    return (f"  compiled shallow copies of {s['layers'][0]} and {s['layers'][1]} layers "
            f"({s['field']}, unit {s['unit']}) and extrapolated to the full depth; "
            f"dry run {r['dry_run_seconds']:.0f} s at compile effort {r['compile_effort']:g} "
            f"(without --shallow: the whole model)")
  return (f"  compiled the full model ({r.get('compile_path_reason')}); dry run "
          f"{r['dry_run_seconds']:.0f} s at compile effort {r['compile_effort']:g}")
