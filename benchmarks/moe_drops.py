"""What a bet on balance drops: the token copies a fixed exchange buffer would lose, measured
on a trained router's choices.

    JAX_PLATFORMS=cpu shardax --exp=moe.deepseek_tiny --job_dir=/tmp/dstiny        # train first
    JAX_PLATFORMS=cpu python benchmarks/moe_drops.py --exp=moe.deepseek_tiny --job_dir=/tmp/dstiny

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

This script restores the latest checkpoint of `--job_dir`, runs the evaluation forward over
`--batches` validation batches, reads every MoE layer's routing (the chosen experts of each
token; `jax.debug.callback` from the dropless dispatch) and prices both bets for a virtual
layout: the experts split over `--devices` devices in contiguous blocks (as the expert
mesh axis splits them), each sequence one sender. It prints, per bet and buffer, the
fraction of token copies dropped (over all layers and tokens) and the worst layer's.
Routing does not depend on the layout, so one forward prices any layout.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--exp", default="moe.deepseek_tiny")
  p.add_argument("--job_dir", required=True)
  p.add_argument("--set", action="append", default=[], help="config override PATH=VALUE")
  p.add_argument("--devices", type=int, default=8, help="devices the experts are split over")
  p.add_argument("--groups", default="8,64", help="senders (each one sequence) per expert group (ragged), comma-separated")
  p.add_argument("--buffers", default="1.0,1.1,1.25,1.5,2.0", help="expert_buffer values, comma-separated")
  p.add_argument("--pieces", type=int, default=1,
                 help="model.moe.dispatch_chunks: each sender's tokens in this many contiguous pieces, "
                      "each exchanged (and bounded) on its own")
  p.add_argument("--batches", type=int, default=8)
  p.add_argument("--batch", type=int, default=64, help="sequences per evaluation batch (a multiple of each group)")
  return p.parse_args()


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


def main():
  args = parse()
  import jax
  import numpy as np
  from shardax import configs
  from shardax.layers import moe_dispatch
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import checkpoint, loop, model_setup
  from shardax.trainer.data import inputs

  cfg = configs.get(args.exp)
  configs.apply_overrides(cfg, args.set)
  exp = configs.build(cfg)
  m = exp.model.moe
  if m is None or m.dispatch != "dropless":
    raise SystemExit(f"{args.exp}: needs a dropless MoE (model.moe.dispatch='dropless')")
  if m.num_experts % args.devices:
    raise SystemExit(f"--devices={args.devices} must divide the {m.num_experts} experts")
  groups = [int(g) for g in args.groups.split(",")]
  if any(args.batch % g for g in groups):
    raise SystemExit(f"--batch={args.batch} must be a multiple of each of --groups={groups}")
  buffers = [float(b) for b in args.buffers.split(",")]

  routed = []   # one [b, l, k] per MoE layer per batch, in the order the layers run
  original = moe_dispatch.dropless

  def recording(x, index, *a, **kw):
    jax.debug.callback(lambda i: routed.append(np.asarray(i)), index, ordered=True)
    return original(x, index, *a, **kw)

  moe_dispatch.dropless = recording
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
  print(f"  {'bet':28s} " + " ".join(f"{'buffer ' + str(x):>14s}" for x in buffers))
  rows = [("padded (per piece)", lambda c, x: dropped(c, fair, x))]
  rows += [(f"ragged (group of {g} pieces)", lambda c, x, g=g: dropped(c.reshape(-1, g, c.shape[1]).sum(1), fair * g, x))
           for g in groups]
  for name, lost in rows:
    cells = []
    for x in buffers:
      per_layer = [sum(lost(loads[j], x) for j in range(layer, len(loads), moe_layers))
                   / sum(loads[j].sum() for j in range(layer, len(loads), moe_layers)) for layer in range(moe_layers)]
      cells.append(f"{sum(lost(c, x) for c in loads) / total:7.2%} ({max(per_layer):5.1%})")
    print(f"  {name:28s} " + " ".join(f"{c:>14s}" for c in cells))
  print("  (fraction of all token copies dropped; in brackets the worst MoE layer's)")


if __name__ == "__main__":
  main()
