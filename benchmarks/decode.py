"""Decode speed: KV-cached against uncached generation, side by side, per batch size.

    JAX_PLATFORMS=cpu python benchmarks/decode.py                      # lm.tiny, 512 new tokens
    JAX_PLATFORMS=cpu python benchmarks/decode.py --batches=1,2,4,8 --new_tokens=128
    JAX_PLATFORMS=cpu python benchmarks/decode.py --devices=8 --set mesh.ici=(2,4) --set sharding.preset="'2d'"
    JAX_PLATFORMS=cpu python benchmarks/decode.py --exp=lm.gemma3_27b --cache_only --context=32768

Both paths are `trainer.decode.Generator` on the same params and prompts, greedy, no
stop tokens, so both make exactly `--new_tokens` tokens per row (the script checks
that they make the SAME tokens before it reports anything). Cached: one prefill pass
over the prompts, then a `lax.while_loop` of one-token steps reading the cache.
Uncached (what `--mode=decode` did before the cache): every step reruns the model
over the whole [batch, prompt + new_tokens] window, one compiled shape.

For each batch size both are compiled and run once untimed, then timed alternately
`--rounds` times (cached, uncached, cached, ...); the best round of each is reported
(the machine is shared: the best is the least disturbed). Figures:
  prefill tok/s   prompt tokens (rows x prompt_len) / prefill seconds
  gen tok/s       new tokens (rows x new_tokens) / generate-loop seconds
  ms/token        generate-loop seconds / steps: the latency of one step (one new
                  token for every row)
  cache/device    bytes of the KV cache on one device (k and v, all layers)
  cache/sequence  bytes of one sequence's cache as decoding builds it (windowed and chunked
                  layers: a ring of window / chunk slots, layers/attention.py), and with every
                  layer caching all positions (the layout before rings)
The params are freshly initialized (speed does not depend on training). `--cache_only`
prints the two cache/sequence figures at `--context` positions from the cache specs alone
(no params, no run), so pod-sized models (lm.gemma3_27b at 32k) are measured on a laptop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--exp", default="lm.tiny")
  p.add_argument("--set", action="append", default=[], help="config override PATH=VALUE")
  p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
  p.add_argument("--prompt_len", type=int, default=64)
  p.add_argument("--new_tokens", type=int, default=512)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--devices", type=int, default=1, help="simulated CPU devices")
  p.add_argument("--no_uncached", action="store_true", help="time the cached path only")
  p.add_argument("--out", default=None, help="also write the figures here as JSON")
  p.add_argument("--cache_only", action="store_true",
                 help="print the decode cache's bytes per sequence (rings vs full) at --context, then stop")
  p.add_argument("--context", type=int, default=None,
                 help="positions of the --cache_only figures (default prompt_len + new_tokens)")
  return p.parse_args()


def main():
  args = parse()
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  import numpy as np
  from shardax import configs
  from shardax.sharding import make_mesh
  from shardax.trainer import decode, decode_cache
  from shardax.trainer import state as state_lib

  cfg = configs.get(args.exp)
  if args.cache_only:
    return print_cache_bytes(cfg, args)
  window = args.prompt_len + args.new_tokens
  configs.apply_overrides(cfg, [f"model.max_len={window}", f"data.seq_len={window}", "data.source='synthetic'",
                                f"mesh.ici=({args.devices}, 1)", *args.set])
  exp = configs.build(cfg)
  setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:args.devices]))
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  cached = decode.Generator(exp.model, params, setup.mesh, setup.rules)
  uncached = decode.Generator(exp.model, params, setup.mesh, setup.rules, use_cache=False)
  s = decode.Sampling(max_new_tokens=args.new_tokens)
  rng = np.random.default_rng(0)
  rows = []
  for b in [int(x) for x in args.batches.split(",")]:
    prompts = [rng.integers(1, 256, size=args.prompt_len).astype(np.int32) for _ in range(b)]
    first = cached.run(prompts, s)                                   # compile + warm up
    if not args.no_uncached:
      check = uncached.run(prompts, s)
      if not np.array_equal(first.ids, check.ids):
        raise SystemExit(f"batch {b}: cached and uncached decoding made different tokens")
    best_c = best_u = None
    for _ in range(args.rounds):
      r = cached.run(prompts, s)
      best_c = r if best_c is None or r.generate_s < best_c.generate_s else best_c
      if not args.no_uncached:
        r = uncached.run(prompts, s)
        best_u = r if best_u is None or r.generate_s < best_u.generate_s else best_u
    tokens, _ = cached.padded(prompts, args.new_tokens)
    per_device = decode_cache.cache_bytes_per_device(cached.cache_spec(*tokens.shape),
                                                     cached.cache_shardings(*tokens.shape))
    row = {"batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "steps": best_c.steps,
           "prefill_tok_s": b * args.prompt_len / best_c.prefill_s,
           "cached_gen_tok_s": b * best_c.steps / best_c.generate_s,
           "cached_ms_per_token": 1e3 * best_c.generate_s / best_c.steps,
           "cache_bytes_per_device": per_device}
    row["cache_bytes_per_sequence"], row["full_cache_bytes_per_sequence"] = decode_cache.cache_bytes_per_sequence(
        cached.cache.model, tokens.shape[1])
    if best_u is not None:
      row.update({"uncached_gen_tok_s": b * best_u.steps / best_u.generate_s,
                  "uncached_ms_per_token": 1e3 * best_u.generate_s / best_u.steps})
      row["speedup"] = row["cached_gen_tok_s"] / row["uncached_gen_tok_s"]
    rows.append(row)
    print(format_row(row), flush=True)
  result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "exp": args.exp, "overrides": args.set, "devices": args.devices,
            "backend": jax.default_backend(), "rows": rows}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  print(format_table(result))


def print_cache_bytes(cfg, args) -> None:
  """The decode cache of one sequence at --context positions, from the specs: as decoding builds
  it (rings on windowed / chunked layers) and with every layer caching every position."""
  from flax import nnx
  from shardax import configs, models
  from shardax.trainer import decode_cache
  context = args.context or args.prompt_len + args.new_tokens
  configs.apply_overrides(cfg, [f"model.max_len={context}", *args.set])
  exp = configs.build(cfg)
  model = nnx.eval_shape(lambda: models.build(decode_cache.decode_config(exp.model), nnx.Rngs(0)))
  ring, full = decode_cache.cache_bytes_per_sequence(model, context)
  date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  print(f"decode cache {date}: {args.exp} {' '.join(args.set)} at {context} positions, one sequence: "
        f"{ring:,} bytes ({ring / 2**30:.2f} GiB) with rings on the windowed/chunked layers, {full:,} "
        f"({full / 2**30:.2f} GiB) with every layer caching all positions: {full / ring:.2f}x less")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"date": date, "exp": args.exp, "overrides": args.set, "context": context,
                 "cache_bytes_per_sequence": ring, "full_cache_bytes_per_sequence": full}, f, indent=1)


def format_row(r) -> str:
  u = (f"  uncached {r['uncached_gen_tok_s']:.1f} tok/s {r['uncached_ms_per_token']:.2f} ms/token"
       f"  speedup {r['speedup']:.1f}x") if "speedup" in r else ""
  return (f"batch {r['batch']}: prefill {r['prefill_tok_s']:.0f} tok/s  cached {r['cached_gen_tok_s']:.1f} "
          f"tok/s {r['cached_ms_per_token']:.2f} ms/token{u}  cache {r['cache_bytes_per_device']:,} B/device, "
          f"{r['cache_bytes_per_sequence']:,} B/sequence ({r['full_cache_bytes_per_sequence']:,} without rings)")


def format_table(result) -> str:
  lines = [f"decode benchmark {result['date']}: {result['exp']} {' '.join(result['overrides'])} on "
           f"{result['devices']} {result['backend']} device(s), greedy",
           "| batch | prompt | new | prefill tok/s | cached gen tok/s | cached ms/token | "
           "uncached gen tok/s | uncached ms/token | cached/uncached | KV cache bytes/device | "
           "cache bytes/sequence (without rings) |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    u = (f"{r['uncached_gen_tok_s']:.1f} | {r['uncached_ms_per_token']:.2f} | {r['speedup']:.1f}x"
         if "speedup" in r else "- | - | -")
    lines.append(f"| {r['batch']} | {r['prompt_len']} | {r['new_tokens']} | {r['prefill_tok_s']:.0f} | "
                 f"{r['cached_gen_tok_s']:.1f} | {r['cached_ms_per_token']:.2f} | {u} | "
                 f"{r['cache_bytes_per_device']:,} | {r['cache_bytes_per_sequence']:,} "
                 f"({r['full_cache_bytes_per_sequence']:,}) |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
