"""Dropless against capacity-based MoE dispatch: train-step time of the same model, side by side.

    .venv/bin/python benchmarks/moe_dispatch.py                                # moe.mixtral_tiny, this CPU
    python benchmarks/moe_dispatch.py --set model.d_model=1024 \\
        --set model.num_heads=8 --set model.moe.d_ff=2048 \\
        --set model.dtype="'bfloat16'" --set train.global_batch=16 \\
        --set data.seq_len=1024 --set model.max_len=1024         # a GPU-sized one

One top-2 MoE experiment (`--exp`, default moe.mixtral_tiny: top-2 of 8, renormalized
softmax gates) is built twice, differing only in `model.moe.dispatch`:
  dropless  tokens sorted by expert, one grouped matmul per expert matrix (jax.lax.ragged_dot,
            or the batched-tile form on CPU: `model.moe.grouped_matmul`), nothing dropped;
  capacity  GShard's dispatch/combine einsums over C = capacity_factor x 2S/E slots per
            expert and group (`--capacity_factor`, default 1.25), second expert always kept
            ('all', as Mixtral routes), tokens past C dropped.
Both steps are compiled ahead of time, start from the same initial state and cycle through
the same RING device-resident batches of the experiment's own data. They then alternate in
ABBA order (neither always runs first), `--steps` timed steps each per round for `--rounds`
rounds, every step ended by `block_until_ready`. Printed per dispatch: median step time,
tokens/s, compiled FLOPs per step (XLA's count: the capacity path's einsums multiply the
empty slots too; on a GPU the cuBLAS calls are not counted), the step's memory, and the
capacity path's dropped-token fraction; then the ratio dropless/capacity of tokens/s as
the median of back-to-back pairs (each dropless step against the capacity step next to it,
which saw the same machine load).

`--chunks N --dispatch D` instead compares one dispatch D in one piece against N pieces
(`model.moe.dispatch_chunks`, each its own all-to-all and expert FFN) on every device the
process has (8 simulated CPU devices: `--set mesh.num_cpu_devices=8`, experts 8-way):
    python benchmarks/moe_dispatch.py --chunks 2 --dispatch capacity --set mesh.num_cpu_devices=8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import jax
import numpy as np

from shardax import configs
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from shardax.trainer.data import inputs
from shardax.perf import benchmark, costs

RING = benchmark.RING


def build(name: str, dispatch: str, capacity_factor: float, overrides: list[str]):
  cfg = configs.get(name)
  extra = [f"model.moe.dispatch='{dispatch}'"]
  if dispatch == "capacity":
    extra += ["model.moe.second_expert='all'", f"model.moe.capacity_factor={capacity_factor}"]
  configs.apply_overrides(cfg, list(overrides) + extra)
  exp = configs.build(cfg)
  if exp.model.moe.top_k != 2:
    raise SystemExit(f"{name}: top_k={exp.model.moe.top_k}; the capacity dispatch is GShard's top-2, "
                     "so the comparison needs a top-2 experiment (--set model.moe.top_k=2)")
  return exp


class Runner:
  """One dispatch's compiled step, state and batch ring."""

  def __init__(self, exp, devices):
    self.exp = exp
    self.setup = state_lib.create(exp, make_mesh(exp.mesh, devices))
    t = exp.train
    with self.scope():
      self.state = state_lib.init_fn(self.setup)(jax.random.key(t.seed))
      t0 = time.perf_counter()
      self.step = step_lib.compile_train_step(self.setup)
      self.compile_s = time.perf_counter() - t0
      source = inputs.Batches(exp.data, "train", t.global_batch, self.setup.batch_sharding,
                              seed=exp.data.seed, vocab_size=exp.model.vocab_size)
      self.ring = [next(source) for _ in range(RING)]
    self.i, self.times, self.metrics = 0, [], None

  @contextlib.contextmanager
  def scope(self):
    with jax.set_mesh(self.setup.mesh), use_rules(self.setup.rules, self.exp.sharding.allow_uneven):
      yield

  def run(self, n: int, record: bool = True) -> list[float]:
    out = []
    with self.scope():
      for _ in range(n):
        t0 = time.perf_counter()
        self.state, self.metrics = self.step(self.state, self.ring[self.i % RING])
        jax.block_until_ready((self.state, self.metrics))
        out.append(time.perf_counter() - t0)
        self.i += 1
    if record:
      self.times += out
    return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--exp", default="moe.mixtral_tiny")
  ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
  ap.add_argument("--capacity_factor", type=float, default=1.25)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="timed steps per dispatch per round")
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--chunks", type=int, default=0, help="compare dispatch_chunks=1 against this")
  ap.add_argument("--dispatch", default="capacity", help="with --chunks: the dispatch compared")
  args = ap.parse_args()
  if args.chunks:
    return compare_chunks(args)

  devices = jax.devices()[:1]
  runners = {d: Runner(build(args.exp, d, args.capacity_factor, args.overrides), devices)
             for d in ("dropless", "capacity")}
  for r in runners.values():
    r.run(args.warmup, record=False)
  pairs = []
  for k in range(args.rounds):
    order = ("dropless", "capacity") if k % 2 == 0 else ("capacity", "dropless")
    got = {d: runners[d].run(args.steps) for d in order}
    pairs += [c / d for d, c in zip(got["dropless"], got["capacity"])]

  exp = runners["dropless"].exp
  tokens = exp.train.global_batch * exp.model.tokens_per_example(exp.data)
  dev = devices[0]
  print(f"{args.exp} on 1 x {dev.device_kind} ({dev.platform}), {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}; batch {exp.train.global_batch} x {exp.data.seq_len}, "
        f"E={exp.model.moe.num_experts} top-2, expert d_ff {exp.model.moe.d_ff}, "
        f"{args.rounds} ABBA rounds x {args.steps} steps")
  for d, r in runners.items():
    med = float(np.median(r.times))
    flops = costs.of_compiled(r.step).flops if dev.platform != "gpu" else float("nan")
    mem = benchmark.device_memory(r.step).get("memory_gib_per_device", float("nan"))
    dropped = float(r.metrics.get("moe/dropped_fraction", 0.0))
    print(f"{d:<9} step {med * 1e3:8.1f} ms median  {tokens / med:10,.0f} tokens/s  "
          f"compiled {flops:.3g} FLOPs/step  memory {mem:.2f} GiB  dropped {dropped:.1%}  "
          f"(compile {r.compile_s:.1f} s)")
  print(f"dropless / capacity tokens/s: {np.median(pairs):.3f} (median of {len(pairs)} back-to-back pairs; "
        f"ratio of medians {np.median(runners['capacity'].times) / np.median(runners['dropless'].times):.3f})")


def compare_chunks(args) -> None:
  """One piece (old) against `args.chunks` pieces (new), ABBA, on all devices."""
  names = ("chunks=1", f"chunks={args.chunks}")
  runners = {}
  for name, n in zip(names, (1, args.chunks)):
    exp = build(args.exp, args.dispatch, args.capacity_factor,
                args.overrides + [f"model.moe.dispatch_chunks={n}"])
    runners[name] = Runner(exp, None)
  for r in runners.values():
    r.run(args.warmup, record=False)
  for k in range(args.rounds):
    for name in (names if k % 2 == 0 else names[::-1]):
      runners[name].run(args.steps)
  exp = runners[names[0]].exp
  print(f"{args.exp}, {args.dispatch} dispatch, mesh {dict(runners[names[0]].setup.mesh.shape)}, "
        f"load {os.getloadavg()[0]:.1f}; {args.rounds} ABBA rounds x {args.steps} steps")
  meds = {n: float(np.median(r.times)) for n, r in runners.items()}
  for n, med in meds.items():
    print(f"{n:<9} step {med * 1e3:8.1f} ms median")
  print(f"new / old step time (ratio of medians): {meds[names[1]] / meds[names[0]]:.3f}")


if __name__ == "__main__":
  main()
