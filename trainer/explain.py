"""`--mode=explain`: where every parameter and activation lives, and what the step communicates.

Compiles the real train step from abstract shapes (nothing allocated) on the
experiment's mesh (a TPU topology too, with `mesh.topology`) and reads the compiled
program: per-parameter placement, per-device memory and its largest buffers
(perf/buffers.py), an MoE's bet on balance where it makes one (token copies past
a finite capacity or expert buffer dropped: trainer/moe_drops.py), FLOPs, and each collective
with the model source line that caused it (HLO metadata). Activation shardings
come from tracing the forward pass: every `shard(x, logical_axes)` the model makes
is a sharding constraint in the jaxpr, with its shape, spec and source line, so
the model code needs no hook.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os

import jax
import numpy as np

import shardax
from shardax.configs.schema import Experiment
from shardax.sharding import report, use_rules
from shardax.trainer import jobdir
from shardax.perf import buffers as buffers_lib, dry_run
from shardax.trainer import decode_cache, moe_drops
from shardax.trainer import step as step_lib

_PACKAGE = os.path.dirname(os.path.abspath(shardax.__file__))
_SHARDING = os.path.join(_PACKAGE, "sharding")


@dataclasses.dataclass(frozen=True)
class Activation:
  source: str                # file:line of the model code that annotated it
  shape: tuple[int, ...]     # global shape
  dtype: str
  spec: str                  # its PartitionSpec over the mesh
  bytes_per_device: int
  count: int                 # how often the forward pass hits this annotation (per trace)


def _source(eqn) -> str:
  """The innermost frame in shardax outside sharding/ (the layer that called shard())."""
  tb = eqn.source_info.traceback
  for frame in (tb.frames if tb is not None else ()):
    path = os.path.abspath(frame.file_name)
    if (path.startswith(_PACKAGE + os.sep) and not path.startswith(_SHARDING + os.sep)
        and "site-packages" not in path):
      return f"{os.path.relpath(path, _PACKAGE)}:{frame.line_num}"
  return "-"


def _constraints(jaxpr):
  """Every sharding_constraint eqn in a jaxpr and the jaxprs nested in it (scan, remat, ...)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "sharding_constraint":
      yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _constraints(inner)


def activation_table(setup) -> list[Activation]:
  """Shardings of the forward pass's annotated activations, one row per distinct annotation."""
  batch = step_lib.abstract_batch(setup)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, setup.exp.sharding.allow_uneven):
    closed = jax.make_jaxpr(step_lib.loss_fn(setup))(setup.abstract["params"], batch)
  counts: dict[tuple, int] = collections.Counter()
  for eqn in _constraints(closed.jaxpr):
    aval, sharding = eqn.invars[0].aval, eqn.params["sharding"]
    local = sharding.shard_shape(aval.shape)
    key = (_source(eqn), tuple(aval.shape), str(aval.dtype), str(sharding.spec),
           math.prod(local) * np.dtype(aval.dtype).itemsize)
    counts[key] += 1
  return [Activation(*key, count=n) for key, n in counts.items()]


def format_activations(rows: list[Activation]) -> str:
  header = ("activation (source)", "shape", "dtype", "spec", "bytes/device", "x")
  body = [(r.source, str(r.shape), r.dtype, r.spec, f"{r.bytes_per_device:,}", str(r.count)) for r in rows]
  widths = [max(len(x[i]) for x in [header] + body) for i in range(len(header))]
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in body])


def latent_cache_line(model) -> str | None:
  """What multi-head latent attention's decode cache takes per token and layer (the latent and
  the shared RoPE key) against full keys and values of every head; None without `model.mla`."""
  m = model.mla
  if m is None:
    return None
  size = np.dtype(model.dtype).itemsize
  latent, full = m.cache_per_token(), m.full_kv_per_token(model.num_heads)
  return (f"decode cache per token and layer (MLA): latent {m.kv_lora_rank} + RoPE key {m.qk_rope_head_dim} "
          f"= {latent * size:,} bytes, against {full * size:,} for full keys and values ({model.num_heads} "
          f"heads x ({m.qk_head_dim} + {m.v_head_dim})): {full / latent:.1f}x less")


def mtp_line(model, seq_len: int) -> str | None:
  """Multi-token prediction's share of the parameters and of the model FLOPs per token
  (configs/flops.py counts both in); None without `model.mtp`."""
  if model.mtp is None:
    return None
  from shardax.configs import flops
  params, total = flops.mtp_params(model), flops.param_count(model)
  per_token, all_flops = flops.mtp_flops_per_token(model, seq_len), flops.per_token(model, seq_len)
  return (f"multi-token prediction: {model.mtp.depth} module(s), {params:,} params ({100 * params / total:.2f}% of "
          f"{total:,}), {per_token:.4g} training FLOPs per token ({100 * per_token / all_flops:.2f}% of the model "
          f"FLOPs, which count them), loss weight {model.mtp.loss_weight}; never run by eval or decode")


def explain(exp: Experiment, job_dir: str | None = None) -> str:
  mesh, setup = dry_run.prepare(exp)
  bet = moe_drops.bet(exp, dict(mesh.shape), setup.rules)
  compiled, buffers = dry_run.compile_with_buffers(setup)
  if isinstance(compiled, Exception):  # does not fit: --mode=dry_run says by how much, and why
    raise compiled
  activations = activation_table(setup)
  rows = report.param_table(setup.abstract["params"], setup.shardings["params"], setup.param_axes)
  hlo = compiled.as_text()
  summary = report.collective_summary(hlo)
  memory = report.memory(compiled)
  lines = [f"experiment {exp.name}: mesh {dict(mesh.shape)}, rules {list(setup.rules)}", "",
           report.format_param_table(rows), "",
           format_activations(activations), "",
           "batch sharding: " + ", ".join(f"{k} {v.spec}" for k, v in setup.batch_sharding.items()),
           "memory per device: " + ", ".join(f"{k} {v:,}" for k, v in memory.items()),
           *filter(None, [bet]),
           *filter(None, [decode_cache.cache_summary(exp, mesh, setup.rules), latent_cache_line(exp.model),
                          mtp_line(exp.model, exp.data.seq_len)]),
           *buffers_lib.format_table(buffers),
           f"compiler FLOPs per device per step: {report.flops(compiled):.4g}", "",
           report.format_collectives(summary), ""]
  for c in report.collectives(hlo):
    lines.append(f"  {c.kind:<20} {c.bytes:>12,} B x{c.executions:<4} group {c.group_size:<3} "
                 f"{c.source or '-'}  {c.op_name}")
  text = "\n".join(lines)
  if job_dir:
    jobdir.write_text(jobdir.path(job_dir) / "explain.txt", text + "\n")
    jobdir.write_text(jobdir.path(job_dir) / "explain.json", json.dumps({"params": [r.__dict__ for r in rows],
                 "activations": [dataclasses.asdict(a) for a in activations],
                 "memory": memory, "buffers": [dataclasses.asdict(b) for b in buffers],
                 "collectives": summary,
                 "collective_ops": [dataclasses.asdict(c) for c in report.collectives(hlo)],
                 "flops_per_device": report.flops(compiled), "balance_bet": bet}, indent=2, default=str))
  return text
