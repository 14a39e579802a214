"""The slowest ops of a profiled benchmark, from its trace, without TensorBoard.

    python -m shardax.main --exp=lm.1b --job_dir=J --mode=benchmark --set 'train.profile_steps=(5,7)'
    python benchmarks/op_profile.py J [--top 25]

`--mode=benchmark` with `train.profile_steps` writes a jax profiler trace under J/profile,
including `perfetto_trace.json.gz` (Chrome trace JSON). This reads the device timelines
(`/device:GPU:0`, `/device:TPU:0`, ...; on a CPU, the XLA worker threads) and prints each
op's total time, its share of the device's busy time, and a coarse class (matmul, attention,
fusion, collective, copy...), grouped by the HLO op where the trace names it, else by kernel.
The busy fraction (busy / span of the device timeline) shows launch gaps and host stalls.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

CLASSES = [  # (class, pattern on the kernel or op name), first match wins
    ("attention", r"fmha|flash|cudnn.*attn|dot_product_attention|custom-call.*attn"),
    ("matmul", r"gemm|cublas|cutlass|matmul|\bdot\b|dot\.|dot_general|convolution|wgmma|sm90_xmma|nvjet"),
    ("collective", r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|nccl"),
    ("copy", r"copy|memcpy|memset|transpose|dynamic-update-slice"),
    ("fusion", r"fusion|loop_|input_|reduce|triton"),
]


def classify(name: str) -> str:
  """The class of "HLO-op kernel jax-op-path": by the HLO op and kernel names, else by the
  jax op (a cuBLAS call is `custom-call.N` running `nvjet_*`, from a `dot_general`)."""
  op_and_kernel, _, jax_op = name.rpartition(" ")
  for text in (op_and_kernel.lower(), jax_op.lower()):
    found = next((c for c, pat in CLASSES if re.search(pat, text)), None)
    if found:
      return found
  return "other"


def load(path: str) -> list[dict]:
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
      raise SystemExit(f"no perfetto_trace.json.gz under {path}: run --mode=benchmark with "
                       f"--set 'train.profile_steps=(FIRST,LAST)'")
    path = found[-1]
  with gzip.open(path) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: list[dict]) -> tuple[str, list[dict]]:
  """(which timeline, its complete events): the first accelerator's, else the CPU's XLA threads."""
  procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  devices = sorted(p for p, n in procs.items() if n.startswith("/device:") and "CPU" not in n)
  if devices:
    pid = devices[0]
    # GPU timelines carry several lines per stream (ops, kernels, XLA modules): keep the
    # kernel / op lines, drop the module and step summaries that would double-count.
    keep = [e for e in events if e.get("ph") == "X" and e["pid"] == pid
            and not re.search(r"module|step|launch|source|framework", threads.get((pid, e.get("tid")), ""), re.I)]
    return procs[pid], keep
  xla = {k for k, n in threads.items() if n.startswith("tf_XLAEigen")}
  return "host CPU (XLA worker threads)", [
      e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in xla
      and not re.search(r"ThunkExecutor|ThreadPool|Await", e["name"])]  # containers of the ops


def summarize(events: list[dict], top: int, by_kind: bool = False) -> str:
  where, evs = device_events(events)
  if not evs:
    return "no device events in the trace"
  by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
  what: dict[str, str] = {}  # op -> kernel name and the jax op it came from, for the class
  for e in evs:
    args = e.get("args") or {}
    key = args.get("hlo_op") or args.get("long_name") or e["name"]
    if by_kind:  # unrolled layers give every layer its own op names: group them
      key = re.sub(r"[._]\d+$", "", key)
    by_op[key][0] += e.get("dur", 0.0)
    by_op[key][1] += 1
    if e.get("dur", 0.0) > 2.0 or key not in what:  # skip the memsets beside a gemm
      what[key] = f"{key} {e['name']} {args.get('name', '')}"
  busy = sum(t for t, _ in by_op.values())
  span = max(e["ts"] + e.get("dur", 0) for e in evs) - min(e["ts"] for e in evs)
  per_class = collections.Counter()
  for k, (t, _) in by_op.items():
    per_class[classify(what[k])] += t
  lines = [f"{where}: {len(evs)} events, busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms span "
           f"({busy / span:.0%}; overlapping streams can exceed 100%)",
           "by class: " + ", ".join(f"{c} {t / busy:.1%}" for c, t in per_class.most_common()),
           f"{'ms':>9} {'share':>6} {'calls':>6}  {'class':<10} op"]
  for k, (t, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
    source = what[k].split(" ", 2)[-1].split("/")[-1]  # the jax primitive, where the trace names it
    lines.append(f"{t / 1e3:9.2f} {t / busy:6.1%} {n:6d}  {classify(what[k]):<10} {k[:60]}  {source[:40]}")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("trace", help="a job dir, its profile folder, or a perfetto_trace.json.gz")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--by-kind", action="store_true",
                  help="group ops by name without their number (fusion.12 and fusion.40 together)")
  args = ap.parse_args()
  print(summarize(load(args.trace), args.top, args.by_kind))


if __name__ == "__main__":
  main()
