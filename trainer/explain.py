"""`--mode=explain`: where every parameter lives and what the train step communicates.

Compiles the real train step from abstract shapes (nothing allocated) on the
experiment's mesh and reads the compiled program: per-parameter placement,
per-device memory, FLOPs, and each collective with the model source line that
caused it (HLO metadata).
"""

from __future__ import annotations

import json
import os

import jax

from shardax.configs.schema import Experiment
from shardax.sharding import make_mesh, report, use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib


def explain(exp: Experiment, job_dir: str | None = None) -> str:
  mesh = make_mesh(exp.mesh)
  with jax.set_mesh(mesh):
    setup = state_lib.create(exp, mesh)
  with jax.set_mesh(mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    compiled = step_lib.compile_train_step(setup)
  rows = report.param_table(setup.abstract["params"], setup.shardings["params"], setup.param_axes)
  hlo = compiled.as_text()
  summary = report.collective_summary(hlo)
  memory = report.memory(compiled)
  lines = [f"experiment {exp.name}: mesh {dict(mesh.shape)}, rules {list(setup.rules)}", "",
           report.format_param_table(rows), "",
           f"batch sharding: {setup.batch_sharding.spec}",
           "memory per device: " + ", ".join(f"{k} {v:,}" for k, v in memory.items()),
           f"compiler FLOPs per device per step: {report.flops(compiled):.4g}", "",
           report.format_collectives(summary), ""]
  for c in report.collectives(hlo):
    lines.append(f"  {c.kind:<20} {c.bytes:>12,} B  group {c.group_size:<3} {c.source or '-'}  {c.op_name}")
  text = "\n".join(lines)
  if job_dir:
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, "explain.txt"), "w") as f:
      f.write(text + "\n")
    with open(os.path.join(job_dir, "explain.json"), "w") as f:
      json.dump({"params": [r.__dict__ for r in rows], "memory": memory, "collectives": summary,
                 "flops_per_device": report.flops(compiled)}, f, indent=2, default=str)
  return text
