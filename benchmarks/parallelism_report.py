"""Per parallelism mode: where the params live and what one train step communicates.

Compiles the real train step (from abstract shapes) of one LM on 8 simulated CPU
devices for each sharding preset and prints, side by side, per-device parameter
bytes, per-device argument bytes (params + optimizer state + batch) and the
collectives with their counts and bytes per step (loops unrolled).

  .venv/bin/python benchmarks/parallelism_report.py
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from shardax import configs  # noqa: E402
from shardax.sharding import make_mesh, report, use_rules  # noqa: E402
from shardax.trainer import state as state_lib  # noqa: E402
from shardax.trainer import step as step_lib  # noqa: E402

MODES = [("dp", "(8,)", "('data',)"), ("fsdp", "(8,)", "('data',)"), ("tp", "(1, 8)", "('data', 'model')"),
         ("2d", "(2, 4)", "('data', 'model')"), ("dp_fsdp_tp", "(2, 2, 2)", "('data', 'fsdp', 'model')")]
MODEL = ["model.num_layers=4", "model.d_model=256", "model.num_heads=8", "model.d_ff=1024",
         "model.max_len=128", "data.seq_len=128", "train.global_batch=32", "data.source='synthetic'"]


def measure(preset: str, ici: str, axes: str) -> dict:
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, MODEL + [f"sharding.preset={preset!r}", f"mesh.ici={ici}", f"mesh.axes={axes}"])
  exp = configs.build(cfg)
  mesh = make_mesh(exp.mesh)
  setup = state_lib.create(exp, mesh)
  with jax.set_mesh(mesh), use_rules(setup.rules):
    compiled = step_lib.compile_train_step(setup)
  rows = report.param_table(setup.abstract["params"], setup.shardings["params"], setup.param_axes)
  return {"mode": preset, "mesh": ici, "params_total": sum(r.bytes_total for r in rows),
          "params_per_device": sum(r.bytes_per_device for r in rows),
          "args_per_device": report.memory(compiled)["argument_bytes"],
          "collectives": report.collective_summary(compiled.as_text())}


def main() -> None:
  results = [measure(*m) for m in MODES]
  print(f"model: {' '.join(MODEL)}; param bytes in total {results[0]['params_total']:,}")
  print(f"{'mode':<11}{'mesh':<11}{'params/dev':>12}{'share':>7}{'args/dev':>12}  collectives per step (count, bytes)")
  for r in results:
    coll = ", ".join(f"{k} {v['count']} x {v['bytes']:,} B" for k, v in sorted(r["collectives"].items()))
    share = r["params_per_device"] / r["params_total"]
    print(f"{r['mode']:<11}{r['mesh']:<11}{r['params_per_device']:>12,}{share:>7.3f}{r['args_per_device']:>12,}  {coll}")


if __name__ == "__main__":
  sys.exit(main())
