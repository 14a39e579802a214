"""`--mode=plan`: which layout should this experiment use on this topology?

For an experiment and its slice (`mesh.topology`, or this process's devices) the
planner enumerates candidate layouts (a `Grid`: mesh shapes over data / model /
stage, sharding presets, remat policies, gradient-accumulation microbatches and,
where the model allows, pipelines: stages x microbatches x circular repeats x model-axis
size, those whose bubble (S-1)/(M*R+S-1) exceeds the grid's `max_bubble` left out
before anything compiles), then for each one:
  1. rejects it with the reason when the config or the mesh cannot work (an axis that
     does not divide the heads, the batch or the layers; a preset naming an axis the
     mesh lacks): the same checks, and messages, as a real run;
  2. drops it when params + optimizer state alone exceed the chip's HBM (exact, from
     the shardings, no compile);
  3. compiles it (the dry run of perf/extrapolate.py) and drops it when the
     compiler says it does not fit (RESOURCE_EXHAUSTED, or a peak over HBM);
  4. ranks what is left by predicted step time (`_predicted_seconds`: the step-time model of
     perf/stepmodel.py), then by memory.
It prints the best layouts with the exact `--set` line that selects each, and writes
`plan.json` (every candidate, its status, reason and figures) into the job dir, before and
after each candidate. libtpu can abort the process on a program it fails to compile (at effort
-1 it did on pipelined MoEs: a plan of `moe.maverick_4slices_1m` at R=3, dry runs of
`moe.maverick_4slices` and `_1m`; a CHECK in its all-reduce emitter): run the same command
again and the plan resumes, keeping the rows done and marking the candidate it died in as
rejected, with the reason, instead of compiling it again.
MoE experiments with an `expert` mesh axis have their own grid (`MOE_PODS`,
`_moe_candidates`): the expert axis as the experiment has it or another size, the remat policy and, over
several slices, data across them or a pipeline with its stages over them.

Speed: the planner compiles at effort -1 (jax 0.10's `exec_time_optimization_effort`, jax
0.11's optimization level O0), which skips
most of the TPU backend's code scheduling (the bulk of a compile on a CPU host: ~4-5x
less CPU; the memory plan moves by up to ~11%, see extrapolate.py, so confirm the
winner with `--mode=dry_run`, which compiles at effort 0); with `shallow=True` it compiles
two shallow copies of a scanned stack and extrapolates instead (extrapolate.py; its
temp bytes can be far off, e.g. 8x on pod.lm_1t, so it is not the default).
A scanned stack compiles in about the same time at any depth, so on its own the
shallow path saves time only for unscanned stacks; docs/results/dry_run_compile.md has the figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import time
from typing import Any, Sequence

from shardax import configs
from shardax.pipeline import PipelineError, bubble_fraction
from shardax.sharding import rules as rules_lib
from shardax.sharding.rules import split_over_stages
from shardax.trainer import jobdir
from shardax.perf import hardware
from shardax.perf import dry_run as dry_run_lib
from shardax.perf import extrapolate


def _predicted_seconds(report: dict) -> float | None:
  """The step time a dry-run report predicts: THE one place the planner reads it from."""
  predicted = report.get("predicted")
  return predicted["step_seconds"] if predicted else None


@dataclasses.dataclass(frozen=True)
class Grid:
  """The candidate layouts: every combination of these (tensor axis x remat x microbatches),
  plus pipelines (stages x model axis x pipeline microbatches x circular repeats, remat and
  accumulation of the first entries; only schedules with a bubble <= max_bubble)."""
  model_axis: tuple[int, ...] = (8, 16, 32, 64)     # 2D sharding: model axis size (data = the rest)
  presets: tuple[str, ...] = ("2d",)
  remat: tuple[str, ...] = ("full", "dots_no_batch", "none")
  microbatches: tuple[int, ...] = (1, 2)
  fsdp: bool = True                                   # + one pure-FSDP layout (data = all devices)
  tp: bool = True                                     # + one Megatron-only layout (weights replicated over data)
  pipeline_stages: tuple[int, ...] = (4, 8)           # + pipelines over a `stage` axis (pp_2d)
  pipeline_model_axis: tuple[int, ...] = (16,)
  pipeline_microbatches_per_stage: tuple[int, ...] = (2,)   # M = this x S
  pipeline_repeats: tuple[int, ...] = (1,)            # circular repeats R (S*R must divide the layers)
  max_bubble: float = 1.0
  context_axis: tuple[int, ...] = ()                  # if set: mesh (data, context) of these
                                                      # context sizes instead of (data, model)
  quantization: tuple[str, ...] = ()                  # if set: every layout once per model.quantization
  # MoE experiments with an `expert` mesh axis (`_moe_candidates`): the stages per slice of
  # their pipelines, and the remat policies those try (empty: remat's first).
  pipeline_stages_per_slice: tuple[int, ...] = (1,)
  pipeline_remat: tuple[str, ...] = ()
  # ... and the other expert-axis sizes tried on each slice (data = the rest of the slice),
  # with the experiment's own remat: which torus dims the all-to-alls span is a choice too.
  expert_axis: tuple[int, ...] = ()


# Experiments whose layouts are not the 2D default's. Long-context LMs (experiments/
# long_context.py) shard with FSDP over every chip; the choice is how to keep activations:
# recompute ('full'), park the layer inputs (and projections) in host memory ('offload*'),
# or split the batch into microbatches.
_LONG_CONTEXT = dict(model_axis=(1,), presets=("fsdp",), fsdp=False, tp=False, pipeline_stages=(),
                     remat=("full", "offload", "offload_qkv", "offload_proj"))
# Pipelined experiments: the schedule is the choice. Stages x model axis (data = the rest)
# x microbatches x circular repeats, full remat (the pipeline's one recompute), the
# experiment's own gradient accumulation; bubbles over 8% are not compiled.
PIPELINED = Grid(model_axis=(8,), remat=("full",), microbatches=(2,), fsdp=False, tp=False,
                 pipeline_stages=(4, 8), pipeline_model_axis=(4, 8, 16),
                 pipeline_microbatches_per_stage=(2, 3, 4), pipeline_repeats=(1, 2, 3, 4),
                 max_bubble=0.08)
# MoE experiments with an `expert` mesh axis (the pod MoEs): the experts split over each slice
# as the experiment has them, or over another expert-axis size (which torus dims the
# all-to-alls cross: moe.deepseek_v3 runs faster over v5p's 8 x 8 plane than its 8 x 16 one,
# docs/moe.md); the choice is the remat policy and, over several slices,
# data across them or a pipeline whose stages go over them (its schedule: microbatches x
# circular repeats, bubbles over 25% not compiled; inside a pipeline the lightest remat).
MOE_PODS = Grid(model_axis=(), remat=("full", "moe_matmuls", "moe_returned", "dots", "none"),
                microbatches=(1,), fsdp=False, tp=False, pipeline_stages=(),
                pipeline_microbatches_per_stage=(1, 2, 4), pipeline_repeats=(1, 2, 3, 6),
                max_bubble=0.25, pipeline_stages_per_slice=(1,), pipeline_remat=("none",),
                expert_axis=(16, 32, 64, 128, 256))
GRIDS = {"lm.llama3_8b_8k": Grid(microbatches=(1, 3), **_LONG_CONTEXT),   # 3 seqs per chip
         "lm.llama3_70b_8k": Grid(microbatches=(1,), **_LONG_CONTEXT),    # 1 seq per chip
         # 32k: the sequence split over 4 or 8 chips (context parallelism, preset fsdp_cp).
         "lm.llama3_8b_32k": Grid(**dict(_LONG_CONTEXT, presets=("fsdp_cp",), remat=("full", "offload")),
                                  microbatches=(1,), context_axis=(4, 8))}


def _layout(axes: Sequence[str], ici: Sequence[int], preset: str, slices: int | None = None) -> list[str]:
  """The --sets of one mesh layout. `slices` (multi-slice experiments, those with a mesh.dcn):
  the slices go on the first axis (data, or stage for a pipeline), `ici` is one slice's."""
  dcn = [] if slices is None else [f"mesh.dcn={(slices,) + (1,) * (len(axes) - 1) if slices > 1 else ()!r}"]
  return [f"mesh.axes={tuple(axes)!r}", f"mesh.ici={tuple(ici)!r}", *dcn, f"sharding.preset={preset}"]


def candidates(cfg, num_devices: int, grid: Grid = Grid(), slices: int = 1) -> list[list[str]]:
  """`--set` overrides of every candidate layout for the experiment tree `cfg`, over
  `slices` slices of num_devices / slices devices each (the mesh's `dcn`): data across
  the slices, or a pipeline's stages (a whole number of stages per slice)."""
  if _is_moe_pod(cfg):
    return _moe_candidates(cfg, num_devices, grid, slices)
  prefix = "model."
  out = []
  dcn = slices if slices > 1 or tuple(cfg.mesh.dcn) else None
  axes, sizes = (("data", "context"), grid.context_axis) if grid.context_axis else (("data", "model"), grid.model_axis)
  for preset in grid.presets:
    for m in sizes:
      for remat in grid.remat:
        for micro in grid.microbatches:
          out.append(_layout(axes, (-1, m), preset, dcn)
                     + [f"{prefix}remat={remat}", f"train.microbatches={micro}"])
  base = [f"{prefix}remat={grid.remat[0]}", f"train.microbatches={grid.microbatches[0]}"]
  if grid.fsdp:
    out.append(_layout(("data", "model"), (num_devices // slices, 1), "fsdp", dcn) + base)
  if grid.tp:
    out.append(_layout(("data", "model"), (-1, grid.model_axis[0]), "tp", dcn) + base)
  if cfg.model.pipeline.stages > 1:  # a pipelined experiment's layouts without its pipeline
    out = [sets + _NO_PIPELINE for sets in out]
  if cfg.model.moe is None:  # an MoE model pipelines on its expert mesh (_moe_candidates)
    out += [_layout(("stage", "data", "model"), (s // slices, -1, m), "pp_2d", dcn) + base + schedule
            for s, schedule in _schedules(cfg.model.num_layers, grid.pipeline_stages, grid)
            if s % slices == 0 for m in grid.pipeline_model_axis]
  if grid.quantization:  # 8-bit matmuls (layers/quantization.py) ranked with the layouts
    out = [sets + [f"{prefix}quantization={q}"] for sets in out for q in grid.quantization]
  return out


_NO_PIPELINE = ["model.pipeline.stages=1", "model.pipeline.microbatches=1",
                "model.pipeline.circular_repeats=1", "model.pipeline.delay_shift=False",
                "model.pipeline.grads_in_layout=True"]


def _is_moe_pod(cfg) -> bool:
  return cfg.model.moe is not None and "expert" in tuple(cfg.mesh.axes)


def _moe_candidates(cfg, num_devices: int, grid: Grid, slices: int) -> list[list[str]]:
  """`candidates` of an MoE experiment with an `expert` mesh axis: each slice keeps the
  experiment's expert axis (data = the rest of the slice). Unpipelined: (data, expert) with
  data across the slices, the experiment's rules without their stage rules, once per
  `grid.remat`, and once per other size in `grid.expert_axis` (whole experts per chip) with
  the experiment's remat. Over several slices also pipelines: (stage, data, expert) with
  `pipeline_stages_per_slice` stages in each slice, the rules with ("stage", "stage") and the
  batch split over the stages outside the loop (`rules.split_over_stages`), once per
  schedule whose bubble is at most `max_bubble` and per `pipeline_remat`."""
  moe = cfg.model.moe
  ici = dict(zip(cfg.mesh.axes, cfg.mesh.ici))
  per_slice = num_devices // slices
  known = math.prod(n for a, n in ici.items() if a != "expert" and n > 0)
  expert = ici["expert"] if ici["expert"] > 0 else per_slice // known
  base = rules_lib.without_stages(rules_lib.resolve(cfg.sharding.preset, cfg.sharding.rules))
  multi = slices > 1 or bool(tuple(cfg.mesh.dcn))
  rules = lambda r: ["sharding.preset=None", f"sharding.rules={r!r}"]
  unpipelined = lambda e, remat: [
      "mesh.axes=('data','expert')", f"mesh.ici={(per_slice // e, e)!r}",
      *([f"mesh.dcn={(slices, 1)!r}"] if multi else []), *rules(base),
      f"model.remat={remat}", f"train.microbatches={grid.microbatches[0]}", *_NO_PIPELINE]
  out = [unpipelined(expert, remat) for remat in grid.remat]
  out += [unpipelined(e, cfg.model.remat) for e in grid.expert_axis
          if e != expert and per_slice % e == 0 and moe.num_experts % e == 0]
  staged = split_over_stages((("stage", "stage"),) + base)
  units = (cfg.model.num_layers - moe.first_dense_layers) // moe.every   # what the stages split
  stages = [per * slices for per in grid.pipeline_stages_per_slice
            if per * slices > 1 and per_slice % (per * expert) == 0]
  for s, schedule in _schedules(units, stages, grid):
    per = s // slices
    out += [["mesh.axes=('stage','data','expert')", f"mesh.ici={(per, per_slice // (per * expert), expert)!r}",
             f"mesh.dcn={(slices, 1, 1)!r}", *rules(staged), f"model.remat={remat}",
             f"train.microbatches={grid.microbatches[0]}", *schedule]
            for remat in grid.pipeline_remat or grid.remat[:1]]
  return out


def _schedules(units: int, stages, grid: Grid):
  """(stages, schedule --sets) of every pipeline of `stages` x the grid's circular repeats x
  microbatches per stage whose S*R divides the units and whose bubble is <= grid.max_bubble."""
  for s in stages:
    for r in grid.pipeline_repeats:
      for per_stage in grid.pipeline_microbatches_per_stage:
        if units % (s * r) or bubble_fraction(s, per_stage * s, r) > grid.max_bubble:
          continue
        yield s, [f"model.pipeline.stages={s}", f"model.pipeline.microbatches={per_stage * s}",
                  f"model.pipeline.circular_repeats={r}"]


def set_line(sets: Sequence[str]) -> str:
  """The command-line flags that select a candidate, quoted for a POSIX shell.

  Bare words parse as strings (`sharding.preset=2d`); tuples go in double quotes.
  """
  return " ".join(f"--set {_quote(s.replace(' ', ''))}" for s in sets)


def _quote(s: str) -> str:
  if re.fullmatch(r"[\w.=,-]+", s):
    return s
  return f'"{s}"' if not re.search(r'["$`\\!]', s) else shlex.quote(s)


def _state_bytes(setup) -> int:
  return dry_run_lib._shard_bytes(setup.abstract["params"]) + dry_run_lib._shard_bytes(
      setup.abstract["opt_state"])


@dataclasses.dataclass(frozen=True)
class Base:
  """What a plan varies: a registered experiment and the --set overrides on it. A candidate
  is this tree with its own --sets applied after the overrides, built and checked as a run
  with that command line would be."""
  name: str
  overrides: Sequence[str] = ()

  def __post_init__(self):
    object.__setattr__(self, "overrides", tuple(self.overrides))

  def tree(self, *sets: str):
    """The config tree (unbuilt) of this experiment with `sets` applied after the overrides."""
    cfg = configs.get(self.name)
    configs.apply_overrides(cfg, [*self.overrides, *sets])
    return cfg

  def build(self, *sets: str) -> configs.Experiment:
    """The experiment with `sets` applied after the overrides (its checks raise ConfigError,
    naming the field)."""
    return configs.resolve(self.name, [*self.overrides, *sets])


def evaluate(name: str, overrides: Sequence[str], sets: Sequence[str], *, effort: float = -1.0,
             shallow: bool = False) -> dict[str, Any]:
  """One candidate's row: status "ok" / "does not fit" / "memory unknown" (a shallow dry run
  that cannot extrapolate memory) / "rejected", the reason, the figures."""
  row: dict[str, Any] = {"sets": list(sets), "set_line": set_line(sets), "status": "rejected",
                         "reason": None, "predicted_step_seconds": None, "bytes_per_device": None,
                         "fits": None, "seconds": 0.0}
  start = time.perf_counter()
  try:
    exp = Base(name, overrides).build(*sets)
    _, setup = dry_run_lib.prepare(exp)
  except ValueError as e:  # ConfigError, indivisible dims, unknown axes: the user-facing message
    row["reason"] = str(e).splitlines()[0]
    return row
  hbm = _hbm_bytes(setup.mesh)
  state = _state_bytes(setup)
  if hbm is not None and state > hbm:
    row.update(status="does not fit", fits=False, bytes_per_device=state,
               seconds=time.perf_counter() - start,
               reason=f"params + optimizer state alone need {state / 2**30:.2f} GiB per device "
                      f"> {hbm / 2**30:.2f} GiB HBM (not compiled)")
    return row
  try:
    report = extrapolate.dry_run(exp, full=not shallow, effort=effort)
  except ValueError as e:  # found while tracing: a microbatch the data axes do not divide
    # (PipelineError), a grouped matmul the target refuses in a pipeline stage
    row.update(reason=str(e).splitlines()[0], seconds=time.perf_counter() - start)
    return row
  total = report["bytes_per_device"].get("total")
  row.update(fits=report["fits"], bytes_per_device=total, compile_path=report["compile_path"],
             predicted_step_seconds=_predicted_seconds(report),
             compile_seconds=report["compile_seconds"], seconds=time.perf_counter() - start)
  if report.get("memory_unknown"):  # not ranked: a layout whose memory is unknown may not fit
    row.update(status="memory unknown", reason=report["memory_unknown"])
  elif report["fits"] is False:
    row.update(status="does not fit", reason=report["error"] or
               f"the compiler needs {total / 2**30:.2f} GiB per device > "
               f"{report['hbm_bytes_per_device'] / 2**30:.2f} GiB HBM")
  else:
    row.update(status="ok")
  return row


def _hbm_bytes(mesh) -> int | None:
  chip = hardware.lookup(mesh.devices.flat[0].device_kind)
  return chip.hbm_bytes if chip else None


def rank(rows: list[dict]) -> list[dict]:
  """The candidates that fit, fastest predicted step first (then least memory)."""
  ok = [r for r in rows if r["status"] == "ok"]
  return sorted(ok, key=lambda r: (r["predicted_step_seconds"] if r["predicted_step_seconds"] is not None
                                   else math.inf, r["bytes_per_device"] or 0))


def plan(exp: configs.Experiment, base: Base, job_dir: str | None = None, *, grid: Grid = Grid(),
         effort: float = -1.0, shallow: bool = False, quantization: Sequence[str] = (),
         log=print) -> dict[str, Any]:
  """Evaluate every candidate of `grid`, rank them, write plan.json; returns the plan.
  `exp`: the experiment built from `base` (its mesh is the slice the candidates cover);
  `base`: what each candidate is rebuilt from. `grid`: the default picks the experiment's
  own (GRIDS, MOE_PODS, PIPELINED). `quantization`: also rank these model.quantization
  choices (each layout once per choice)."""
  start = time.perf_counter()
  name, overrides = base.name, base.overrides
  cfg = base.tree()
  if grid == Grid():
    grid = GRIDS.get(name, MOE_PODS if _is_moe_pod(cfg) else
                     PIPELINED if cfg.model.pipeline.stages > 1 else grid)
  if quantization:
    grid = dataclasses.replace(grid, quantization=tuple(quantization))
  mesh, _ = dry_run_lib.prepare(exp)
  slices = len({getattr(d, "slice_index", 0) for d in mesh.devices.flat})
  rows = []

  def result():
    return {"experiment": name, "overrides": list(overrides), "topology": exp.mesh.topology,
            "num_devices": int(mesh.size), "device_kind": mesh.devices.flat[0].device_kind,
            "effort": effort, "shallow": shallow, "grid": dataclasses.asdict(grid),
            "candidates": rows, "ranked": [rows.index(r) for r in rank(rows)],
            "compiled": sum(1 for r in rows if "compile_path" in r),
            "wall_seconds": time.perf_counter() - start}

  earlier, died_in = _earlier_run(job_dir, result(), log)
  for sets in candidates(cfg, int(mesh.size), grid, slices):
    line, again = set_line(sets), ""
    if line in earlier:
      rows.append(earlier[line])
      again = " (from the earlier run)"
    elif line == died_in:
      rows.append(_died_row(sets))
    else:
      if job_dir:  # before and after each candidate: a compiler that aborts the process loses no
        # row, and the rerun knows which candidate it died in
        jobdir.write_text(jobdir.path(job_dir) / "plan.json", json.dumps({**result(), "compiling": line}, indent=2))
      rows.append(evaluate(name, overrides, sets, effort=effort, shallow=shallow))
      if job_dir:
        jobdir.write_text(jobdir.path(job_dir) / "plan.json", json.dumps(result(), indent=2))
    r = rows[-1]
    log(f"  [{len(rows)}] {r['status']:<13} {_seconds(r['predicted_step_seconds']):>9}  "
        f"{_gib(r['bytes_per_device']):>10}  {r['set_line']}{again}"
        + (f"\n      {r['reason']}" if r["reason"] else ""))
  out = result()
  if job_dir:
    jobdir.write_text(jobdir.path(job_dir) / "plan.json", json.dumps(out, indent=2))
  return out


_SAME_PLAN = ("experiment", "overrides", "topology", "num_devices", "device_kind", "effort", "shallow", "grid")


def _earlier_run(job_dir: str | None, now: dict, log) -> tuple[dict[str, dict], str | None]:
  """The rows an earlier `--mode=plan` of the same plan left in job_dir's plan.json (set line ->
  row), and the candidate it was compiling when its process died (a libtpu CHECK failure
  aborts it; so does a kill), or None. A plan.json of another plan is replaced."""
  file = jobdir.path(job_dir) / "plan.json" if job_dir else None
  if file is None or not file.exists():
    return {}, None
  try:
    old = json.loads(jobdir.read_text(file))
  except ValueError:
    log(f"  {file} is not a plan (not JSON): replaced")
    return {}, None
  if any(old.get(k) != json.loads(json.dumps(now[k])) for k in _SAME_PLAN):
    log(f"  {file} holds another plan (experiment, overrides, topology, effort or grid differ): replaced")
    return {}, None
  rows = {r["set_line"]: r for r in old.get("candidates", []) if "set_line" in r}
  died = old.get("compiling")
  log(f"  resuming {file} (to plan afresh, remove it or use another --job_dir): {len(rows)} candidates done"
      + (f"; the process died compiling {died}" if died else ""))
  return rows, died


def _died_row(sets: Sequence[str]) -> dict[str, Any]:
  """The row of a candidate whose compile killed the planner's process in an earlier run: not
  compiled again (it would abort this run too)."""
  return {"sets": list(sets), "set_line": set_line(sets), "status": "rejected", "fits": None,
          "predicted_step_seconds": None, "bytes_per_device": None, "seconds": 0.0,
          "reason": "the planner's process died compiling this layout in an earlier run (a compiler "
                    "abort, e.g. a libtpu CHECK failure, or a kill); not compiled again: try it alone "
                    f"with --mode=dry_run {set_line(sets)} (at the default --compile_effort)"}


def _seconds(s: float | None) -> str:
  return "-" if s is None else f"{s:.3g} s"


def _gib(b: int | None) -> str:
  return "-" if b is None else f"{b / 2**30:.2f} GiB"


def format_plan(p: dict, top: int = 5) -> str:
  """The summary `--mode=plan` prints: counts, then the best layouts with their --set lines."""
  rows = p["candidates"]
  count = {s: sum(1 for r in rows if r["status"] == s)
           for s in ("ok", "does not fit", "memory unknown", "rejected")}
  lines = [f"plan for {p['experiment']} on {p['topology'] or 'local devices'} "
           f"({p['num_devices']} x {p['device_kind']}): {len(rows)} candidates, {p['compiled']} "
           f"compiled, {count['ok']} fit, {count['does not fit']} do not fit, "
           + (f"{count['memory unknown']} memory unknown, " if count["memory unknown"] else "")
           + f"{count['rejected']} rejected; {p['wall_seconds']:.0f} s",
           f"  {'#':>3} {'step':>9} {'memory':>10}  layout"]
  for i, idx in enumerate(p["ranked"][:top]):
    r = rows[idx]
    lines.append(f"  {i + 1:>3} {_seconds(r['predicted_step_seconds']):>9} "
                 f"{_gib(r['bytes_per_device']):>10}  {r['set_line']}")
  if not p["ranked"]:
    lines.append("  no candidate fits: see plan.json for each one's reason")
  else:
    best = rows[p["ranked"][0]]
    lines.append(f"  check the best at full compile effort: shardax --exp={p['experiment']} "
                 f"--job_dir=DIR --mode=dry_run {set_line([*p['overrides'], *best['sets']])}")
  return "\n".join(lines)
