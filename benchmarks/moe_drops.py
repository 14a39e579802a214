"""What a bet on balance drops: the token copies a fixed exchange buffer would lose, measured
on a router's choices, after training (`--job_dir`) or at every step of a run from step 0
(`--from_step0`).

    JAX_PLATFORMS=cpu shardax --exp=moe.deepseek_tiny --job_dir=/tmp/dstiny        # train first
    JAX_PLATFORMS=cpu python benchmarks/moe_drops.py --exp=moe.deepseek_tiny --job_dir=/tmp/dstiny
    JAX_PLATFORMS=cpu python benchmarks/moe_drops.py --from_step0 --record          # a few minutes

The pod MoEs do not size their receive buffers for the worst routing (moe.deepseek_v3's
no-overflow bound does not fit a v5p chip, docs/results/moe_pods.md); they hold `expert_buffer` fair
shares and drop the copies past it (`expert_overflow='drop'`, logged as
`moe/dropped_copies`). What that bet loses depends on how the exchange bounds the buffer:

  padded  (`expert_exchange='padded'`): each (sender, receiver) block holds `buffer` x the
          block's fair share, sender = one device's tokens (a piece of one sequence on the
          pod configs), receiver = one device's experts. A sequence whose tokens favour one
          device's experts overflows its block.
  ragged  (`expert_exchange='ragged'`): each receiver holds `buffer` x its fair share of
          what all the senders of its expert group send (`group` senders), however it is
          split among them: the batch's balance, which bias balancing steers.

Both modes read every MoE layer's routing (the chosen experts of each token;
`jax.debug.callback` from the dropless dispatch) and price both bets for a virtual layout:
the experts split over `--devices` devices in contiguous blocks (as the expert mesh axis
splits them), each sequence one sender. Routing does not depend on the layout, so one
forward prices any layout.

  --job_dir     restores the latest checkpoint and runs the evaluation forward over
                `--batches` validation batches: what a settled router drops.
  --from_step0  trains the experiment from initialization (`--steps`, default its
                train.steps) and prices the routing of every training step's forward, the
                one its gradients and bias update come from: what the bet drops while the
                router and its balance bias are still moving. Default: V3_SHAPED on
                moe.deepseek_tiny (DeepSeek-V3's router at CPU size) over 16 devices of 4
                experts in one expert group of 16, as moe.deepseek_v3 puts 4 of its 256
                experts on each of the 64 chips of an expert group. `--record` writes the
                run's summary for the registered bet (ragged, `--record_buffer`) to
                perf/measured_drops.json, which the dry run prints beside its bet.
Both print, per bet and buffer, the fraction of token copies dropped (over all layers and
tokens) and the worst layer's; `--from_step0` also the curve over the run's steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# DeepSeek-V3's router on moe.deepseek_tiny (4 layers of 192, layer 1 dense, 1 shared expert,
# sigmoid gates x2.5, bias balancing at 1e-3): 64 experts of d_ff 64 in 8 groups, top-8 within
# the best 4 groups, as V3's 256 in 8 groups.
V3_SHAPED = ("model.moe.num_experts=64", "model.moe.top_k=8", "model.moe.n_group=8", "model.moe.topk_group=4")
MEASURED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf", "measured_drops.json")


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--exp", default="moe.deepseek_tiny")
  p.add_argument("--job_dir", help="a trained run to restore (the settled router)")
  p.add_argument("--from_step0", action="store_true", help="train from initialization and price every step")
  p.add_argument("--steps", type=int, default=None, help="--from_step0: steps to train (default train.steps)")
  p.add_argument("--set", action="append", default=None,
                 help="config override PATH=VALUE (default with --from_step0: V3_SHAPED)")
  p.add_argument("--devices", type=int, default=None, help="devices the experts are split over "
                 "(default 8; with --from_step0 16)")
  p.add_argument("--groups", default=None, help="senders (each one sequence piece) per expert group "
                 "(ragged), comma-separated (default 8,64; with --from_step0 16)")
  p.add_argument("--buffers", default="1.0,1.1,1.25,1.5,2.0", help="expert_buffer values, comma-separated")
  p.add_argument("--pieces", type=int, default=1,
                 help="model.moe.dispatch_chunks: each sender's tokens in this many contiguous pieces, "
                      "each exchanged (and bounded) on its own")
  p.add_argument("--batches", type=int, default=8)
  p.add_argument("--batch", type=int, default=64, help="--job_dir: sequences per evaluation batch "
                 "(a multiple of each group)")
  p.add_argument("--record", action="store_true", help="--from_step0: write perf/measured_drops.json")
  p.add_argument("--record_buffer", type=float, default=1.25, help="the ragged buffer --record writes")
  args = p.parse_args(argv)
  if bool(args.job_dir) == args.from_step0:
    p.error("give either --job_dir (a trained router) or --from_step0 (a run from initialization)")
  step0 = args.from_step0
  args.set = list(V3_SHAPED) if args.set is None and step0 else (args.set or [])
  args.devices = args.devices or (16 if step0 else 8)
  args.groups = [int(g) for g in (args.groups or ("16" if step0 else "8,64")).split(",")]
  args.buffers = [float(b) for b in args.buffers.split(",")]
  return args


def chip_counts(index, num_experts: int, devices: int, pieces: int = 1):
  """[b, l, k] expert ids -> [pieces * b, devices]: copies each piece of each sequence sends
  to each device, piece-major (the rows of one piece of every sequence are contiguous)."""
  import numpy as np
  b, l, k = index.shape
  per = num_experts // devices
  dest = np.asarray(index).reshape(b, pieces, l // pieces * k).swapaxes(0, 1).reshape(b * pieces, -1) // per
  return np.stack([np.bincount(row, minlength=devices) for row in dest])


def dropped(counts, fair: float, buffer: float) -> float:
  """Copies past ceil(buffer x fair) per cell of `counts`."""
  import numpy as np
  return float(np.maximum(counts - np.ceil(buffer * fair), 0).sum())


def bets(groups: list[int], fair: float):
  """(name, lost(counts, buffer)) per bet: the padded blocks, then the ragged totals per group."""
  rows = [("padded (per piece)", lambda c, x: dropped(c, fair, x))]
  rows += [(f"ragged (group of {g} pieces)",
            lambda c, x, g=g: dropped(c.reshape(-1, g, c.shape[1]).sum(1), fair * g, x)) for g in groups]
  return rows


def recorder():
  """(routed, restore): from now on every dropless dispatch appends its [b, l, k] expert ids to
  `routed`, in the order the MoE layers run; `restore()` puts the dispatch back."""
  import jax
  import numpy as np
  from shardax.layers import moe_dispatch
  routed, original = [], moe_dispatch.dropless

  def recording(x, index, *a, **kw):
    jax.debug.callback(lambda i: routed.append(np.asarray(i)), index, ordered=True)
    return original(x, index, *a, **kw)

  moe_dispatch.dropless = recording
  return routed, lambda: setattr(moe_dispatch, "dropless", original)


def build(args):
  from shardax import configs
  cfg = configs.get(args.exp)
  configs.apply_overrides(cfg, args.set)
  exp = configs.build(cfg)
  m = exp.model.moe
  if m is None or m.dispatch != "dropless":
    raise SystemExit(f"{args.exp}: needs a dropless MoE (model.moe.dispatch='dropless')")
  if m.num_experts % args.devices:
    raise SystemExit(f"--devices={args.devices} must divide the {m.num_experts} experts")
  return exp


def settled(args):
  """The bets priced on a trained router's evaluation forward (`--job_dir`)."""
  import jax
  import numpy as np
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import checkpoint, loop, model_setup
  from shardax.trainer.data import inputs

  exp = build(args)
  m = exp.model.moe
  if any(args.batch % g for g in args.groups):
    raise SystemExit(f"--batch={args.batch} must be a multiple of each of --groups={args.groups}")
  routed, _ = recorder()
  setup = model_setup.create(exp, make_mesh(exp.mesh))
  params, step = checkpoint.restore_params(setup, args.job_dir)
  sums = loop.eval_sums_fn(setup)
  batches = inputs.eval_batches(exp.data, args.batch, args.batches, setup.batch_sharding)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    for batch in batches:
      jax.block_until_ready(sums(params, batch))
  jax.effects_barrier()
  moe_layers = len(routed) // len(batches)
  b, l, k = routed[0].shape
  if l % args.pieces:
    raise SystemExit(f"--pieces={args.pieces} must divide the {l} tokens of a sequence")
  print(f"{args.exp} at step {step}: {len(batches)} batches x {b} sequences x {l} tokens, "
        f"{moe_layers} MoE layers, top-{k} of {m.num_experts} experts over {args.devices} devices "
        f"({m.num_experts // args.devices} each), each sequence in {args.pieces} piece(s)")
  fair = l // args.pieces * k / args.devices           # one piece's copies per device, balanced
  loads = [chip_counts(r, m.num_experts, args.devices, args.pieces) for r in routed]
  total = sum(c.sum() for c in loads)
  print(f"  max device load over a piece (x fair): median {np.median([c.max(1).mean() / fair for c in loads]):.2f}; "
        f"over a batch: {np.max([c.sum(0).max() / (fair * c.shape[0]) for c in loads]):.2f} (worst layer and batch)")
  print(f"  {'bet':28s} " + " ".join(f"{'buffer ' + str(x):>14s}" for x in args.buffers))
  for name, lost in bets(args.groups, fair):
    cells = []
    for x in args.buffers:
      per_layer = [sum(lost(loads[j], x) for j in range(layer, len(loads), moe_layers))
                   / sum(loads[j].sum() for j in range(layer, len(loads), moe_layers)) for layer in range(moe_layers)]
      cells.append(f"{sum(lost(c, x) for c in loads) / total:7.2%} ({max(per_layer):5.1%})")
    print(f"  {name:28s} " + " ".join(f"{c:>14s}" for c in cells))
  print("  (fraction of all token copies dropped; in brackets the worst MoE layer's)")


def from_step0(args) -> dict:
  """Train from initialization; per step, the fraction of the step's token copies each bet
  drops (all MoE layers) and the worst layer's. Returns the run's record."""
  import jax
  import numpy as np
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import state as state_lib, step as step_lib
  from shardax.trainer.data import inputs

  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  exp = build(args)
  m, steps = exp.model.moe, args.steps or exp.train.steps
  batch_size = exp.train.global_batch
  if any(batch_size * args.pieces % g for g in args.groups):
    raise SystemExit(f"train.global_batch={batch_size} x --pieces={args.pieces} must be a multiple of "
                     f"each of --groups={args.groups}")
  routed, _ = recorder()
  mesh = make_mesh(exp.mesh)
  setup = state_lib.create(exp, mesh)
  names = [name for name, _ in bets(args.groups, 1.0)]
  curve = {name: [] for name in names}   # per step: [buffer] fraction of the step's copies
  worst = {name: [] for name in names}   # per step: [buffer] the worst MoE layer's fraction
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    data = inputs.Batches(exp.data, "train", batch_size, setup.batch_sharding, seed=exp.data.seed,
                          vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))
    state = state_lib.init_fn(setup)(jax.random.key(exp.train.seed))
    train_step = step_lib.train_step_fn(setup)
    losses = []
    for step in range(steps):
      routed.clear()
      state, metrics = train_step(state, next(data))
      losses.append(float(metrics["loss"]))
      jax.effects_barrier()
      b, l, k = routed[0].shape
      fair = l // args.pieces * k / args.devices
      loads = [chip_counts(r, m.num_experts, args.devices, args.pieces) for r in routed]
      total = sum(c.sum() for c in loads)
      for name, lost in bets(args.groups, fair):
        curve[name].append([sum(lost(c, x) for c in loads) / total for x in args.buffers])
        worst[name].append([max(lost(c, x) / c.sum() for c in loads) for x in args.buffers])
      if (step + 1) % 25 == 0 or step == 0:
        print(f"  step {step + 1}: loss {losses[-1]:.3f}, " + ", ".join(
            f"{n.split(' ')[0]} {x:g}: {f:.2%}" for n in names[:2]
            for x, f in zip(args.buffers, curve[n][-1]) if x in (1.25, 2.0)), flush=True)
  seconds = time.perf_counter() - t0
  return {"experiment": args.exp, "overrides": args.set, "steps": steps, "global_batch": batch_size,
          "seq_len": l, "top_k": k, "num_experts": m.num_experts, "moe_layers": len(routed),
          "devices": args.devices, "groups": args.groups, "pieces": args.pieces, "buffers": args.buffers,
          "bias_update_rate": m.bias_update_rate, "curve": curve, "worst_layer": worst,
          "loss_first_last": [losses[0], losses[-1]], "seconds": seconds, "commit": commit}


def windows(steps: int) -> list[tuple[int, int]]:
  """1-based inclusive step windows for the curve summary: the first step, the first 10, then
  fifths of the run."""
  edges = sorted({0, 1, min(10, steps)} | {round(steps * f / 5) for f in range(1, 6)})
  return [(a + 1, b) for a, b in zip(edges, edges[1:]) if b > a]


def summary(run: dict, name: str, buffer: float) -> dict:
  """One bet's curve over the run: the whole run's fraction (every step weighs the same: each
  routes the same number of copies), per window, the worst step, the worst layer of any step,
  and the last step from which every later step stays under 0.01%."""
  import numpy as np
  j = run["buffers"].index(buffer)
  per_step = np.array([s[j] for s in run["curve"][name]])
  under = np.nonzero(per_step >= 1e-4)[0]
  return {"bet": name, "buffer": buffer, "run": float(per_step.mean()),
          "windows": [[a, b, float(per_step[a - 1:b].mean())] for a, b in windows(len(per_step))],
          "worst_step": [int(per_step.argmax()) + 1, float(per_step.max())],
          "worst_layer_any_step": float(max(s[j] for s in run["worst_layer"][name])),
          "under_0.01%_from_step": int(under[-1]) + 2 if len(under) else 1}


def print_summary(run: dict) -> None:
  print(f"{run['experiment']} {' '.join(run['overrides'])}: {run['steps']} steps from initialization "
        f"x {run['global_batch']} sequences x {run['seq_len']} tokens, {run['moe_layers']} MoE layers, top-"
        f"{run['top_k']} of {run['num_experts']} experts over {run['devices']} devices, bias rate "
        f"{run['bias_update_rate']:g}; loss {run['loss_first_last'][0]:.3f} -> {run['loss_first_last'][1]:.3f}; "
        f"{run['seconds']:.0f} s")
  print("  share of the step's token copies dropped, mean over each window of steps "
        "(worst step; worst layer of any step)")
  for name in run["curve"]:
    for x in run["buffers"]:
      s = summary(run, name, x)
      cells = ", ".join(f"{a}-{b}: {f:.2%}" if a != b else f"{a}: {f:.2%}" for a, b, f in s["windows"])
      print(f"  {name} {x:g}: run {s['run']:.3%} | {cells} | worst step {s['worst_step'][0]} "
            f"{s['worst_step'][1]:.2%}; worst layer {s['worst_layer_any_step']:.1%}; " + (
                f"under 0.01% from step {s['under_0.01%_from_step']}"
                if s["under_0.01%_from_step"] <= run["steps"] else "never under 0.01% for good"))


def record(run: dict, buffer: float) -> dict:
  """perf/measured_drops.json's entry for the ragged bet at `buffer` (perf/measured_drops.py)."""
  name = next(n for n in run["curve"] if n.startswith("ragged"))
  s = summary(run, name, buffer)
  return {"expert_exchange": "ragged", "expert_buffer": buffer,
          "experts_per_device": run["num_experts"] // run["devices"], "group": run["groups"][0],
          "model": f"{run['experiment']} with {', '.join(run['overrides'])}", "steps": run["steps"],
          "tokens_per_sender": run["seq_len"] // run["pieces"], "run_fraction": s["run"],
          "windows": s["windows"], "worst_step": s["worst_step"],
          "worst_layer_any_step": s["worst_layer_any_step"], "under_from_step": s["under_0.01%_from_step"],
          "measured": f"{datetime.date.today()} at {run['commit']}, "
                      f"`python benchmarks/moe_drops.py {' '.join(sys.argv[1:])}`"}


def main():
  args = parse()
  if args.job_dir:
    return settled(args)
  run = from_step0(args)
  print_summary(run)
  if args.record:
    with open(MEASURED, "w") as f:
      json.dump([record(run, args.record_buffer)], f, indent=2)
      f.write("\n")
    print(f"wrote {MEASURED}")


if __name__ == "__main__":
  main()
