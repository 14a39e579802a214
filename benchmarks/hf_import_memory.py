"""Peak host memory of an `hf:DIR` import in N real processes, against the checkpoint's size.

    .venv/bin/python benchmarks/hf_import_memory.py [--layers 32] [--processes 4[,2,...]]
        [--devices 2] [--rules fsdp|layers] [--params-only [--in-turn]] [--dir /tmp/hf_import_memory] [--keep]
        [--results docs/results/hf_import_memory.md]

Writes a random-weight Llama-2-7B-shaped checkpoint in bfloat16 with shardax's own
safetensors writer (d_model 4096, d_ff 11008, 32 heads, vocab 32000, untied; `--layers 32`
is 6.74B params, 13.5 GB; fewer layers keep the width), then imports it with
`python -m shardax.main --mode=import` in N processes joined by jax.distributed on CPU,
each with `--devices` CPU devices of its own, all on one `data` axis: `--rules fsdp` (the
hf experiments' default: weights split on their embed dim) or `layers` (the stacked layers
and vocab rows split over `data`, each process reads ~1/N of the file). Params are bf16
(`model.param_dtype`) and the optimizer is Adafactor, whose factored state is small
(Adam's moments would add twice the params). Each process prints its params' bytes on its
devices, its host RSS before the import, its peak RSS (VmHWM) once the params are in
place and after the checkpoint's save, and the bytes it read; the table adds what the kernel
reports for the finished child (ru_maxrss).

`--params-only` stops each process once its params are in place: it runs the same import
(trainer/hf/importer.py `import_params`, on the mesh and rules `--mode=import` builds) but not
the optimizer's init and orbax's save of step 0, whose host copy of the params about doubles
the peak. That is the import's own memory, for sizes this host cannot hold twice.
`--in-turn` (with it) starts the processes together (jax.distributed, the one mesh), then lets
them import one at a time, each freeing its params before the next begins: `import_params`
runs no collective, so each process's figures are those it shows beside the others (or on a
host of its own), while this host holds one process's params at a time instead of them all.

The processes share this host: their params (CPU devices keep them in host memory) add up
to the checkpoint's size. So the script refuses a run for which MemAvailable is less than
twice the estimate (with `--params-only`: the estimate plus HEADROOM; --force overrides) and
runs the processes under `nice`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

from shardax.trainer.hf import safetensors

DM, FF, HEADS, VOCAB = 4096, 11008, 32, 32000
RULES = {"fsdp": "sharding.preset='fsdp'",
         "layers": "sharding.rules=(('batch', 'data'), ('layers', 'data'), ('vocab', 'data'))"}
BASELINE_GUESS = 0.4e9   # a process's RSS before it reads a weight (jax, XLA, the CLI): 0.27 GB seen
HEADROOM = 3e9           # left to the host's other jobs by a --params-only run
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def specs(layers: int) -> list[tuple[str, tuple[int, ...], np.dtype]]:
  """Llama-2-7B's tensors (names and shapes as transformers writes them) for `layers` layers."""
  out = [("model.embed_tokens.weight", (VOCAB, DM))]
  for i in range(layers):
    p = f"model.layers.{i}."
    out += [(p + "input_layernorm.weight", (DM,)), (p + "post_attention_layernorm.weight", (DM,))]
    out += [(p + f"self_attn.{n}_proj.weight", (DM, DM)) for n in "qkvo"]
    out += [(p + "mlp.gate_proj.weight", (FF, DM)), (p + "mlp.up_proj.weight", (FF, DM)),
            (p + "mlp.down_proj.weight", (DM, FF))]
  out += [("model.norm.weight", (DM,)), ("lm_head.weight", (VOCAB, DM))]
  return [(n, s, np.dtype(ml_dtypes.bfloat16)) for n, s in out]


def write_checkpoint(d: str, layers: int) -> int:
  """The model dir `d` (config.json + 2 GB safetensors shards); kept when it already holds
  this config. Returns the checkpoint's tensor bytes."""
  cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DM,
         "intermediate_size": FF, "num_hidden_layers": layers, "num_attention_heads": HEADS,
         "num_key_value_heads": HEADS, "vocab_size": VOCAB, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "hidden_act": "silu", "dtype": "bfloat16"}
  tensors = specs(layers)
  nbytes = sum(int(np.prod(s)) * 2 for _, s, _ in tensors)
  path = os.path.join(d, "config.json")
  if os.path.exists(path) and json.load(open(path)) == cfg and any(
      os.path.exists(os.path.join(d, f)) for f in (safetensors.INDEX, safetensors.SINGLE)):
    return nbytes
  shutil.rmtree(d, ignore_errors=True)
  os.makedirs(d)
  shapes = {n: s for n, s, _ in tensors}
  rng = np.random.default_rng(0)

  def tensor(name):
    # Random bf16 bit patterns with the top exponent bit cleared: finite, |w| < 2.
    bits = np.frombuffer(rng.bytes(2 * int(np.prod(shapes[name]))), np.uint16) & np.uint16(0xBFFF)
    return bits.view(ml_dtypes.bfloat16).reshape(shapes[name])
  t0 = time.time()
  safetensors.write_model(d, tensors, tensor, max_bytes=2 << 30)
  with open(path, "w") as f:   # last: a half-written dir is rewritten next time
    json.dump(cfg, f)
  print(f"wrote {nbytes / 1e9:.2f} GB ({layers} layers) to {d} in {time.time() - t0:.0f}s", flush=True)
  return nbytes


def largest_leaf(layers: int) -> int:
  """Bytes of the largest param leaf (an MLP weight stacked over the layers, or the embedding):
  the importer fills a leaf's shards in host buffers, then copies them to the devices, so on
  CPU devices the processes hold one leaf twice for a moment."""
  return max(layers * FF * DM * 2, VOCAB * DM * 2)


def need_bytes(ckpt: int, layers: int, n: int, params_only: bool, in_turn: bool) -> tuple[int, int]:
  """(estimated peak of n processes together, MemAvailable a run asks for)."""
  if params_only:
    need = (ckpt + largest_leaf(layers)) // (n if in_turn else 1) + n * BASELINE_GUESS
    return need, need + HEADROOM
  need = 2 * ckpt + n * BASELINE_GUESS   # orbax's save holds a host copy of each process's params
  return need, 2 * need


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    return int(next(line for line in f if line.startswith("MemAvailable")).split()[1]) * 1024


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def overrides(n: int, devices: int, rules: str) -> list[str]:
  return [f"mesh.num_cpu_devices={devices}", f"mesh.ici=({n * devices}, 1)", RULES[rules],
          "model.param_dtype='bfloat16'", "model.dtype='bfloat16'", "optimizer.name='adafactor'",
          "checkpoint.async_save=False"]


def command(model: str, job: str, n: int, devices: int, rules: str, port: int, i: int, nice: int,
            params_only: bool = False, in_turn: bool = False) -> list[str]:
  if params_only:   # this script as the child: the import without the save (params_only_child)
    return ["nice", "-n", str(nice), sys.executable, os.path.abspath(__file__), "--child", model,
            str(n), str(devices), rules, str(port), str(i), job if in_turn else ""]
  args = ["nice", "-n", str(nice), sys.executable, "-m", "shardax.main", f"--exp=hf:{model}",
          f"--job_dir={job}", "--mode=import"]
  for s in overrides(n, devices, rules):
    args += ["--set", s]
  if n > 1:
    args += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={n}", f"--process_id={i}"]
  return args


def params_only_child(source: str, n: int, devices: int, rules: str, port: int, i: int, turns: str) -> None:
  """Process i of n: what `--mode=import` does up to the params in place (the same config,
  distributed start, mesh, model setup and `importer.import_params`), then the figures in the
  import's own words, without the optimizer's init and the save of step 0. With `turns` (a
  directory), it imports after process i - 1 wrote `turns`/done_{i-1}, then frees its params and
  writes done_i."""
  import jax
  from shardax import configs
  from shardax.configs import registry
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import distributed, model_setup
  from shardax.trainer.hf import importer
  exp = configs.resolve(f"hf:{source}", overrides(n, devices, rules))
  jax.config.update("jax_num_cpu_devices", devices)
  if n > 1:
    distributed.initialize(f"127.0.0.1:{port}", n, i)
  distributed.agree_at_start(registry.to_json(exp))
  mesh = make_mesh(exp.mesh)
  model = model_setup.create(exp, mesh)
  files = safetensors.Reader(source)
  held, before = importer.held_bytes(model.abstract_params), importer.host_memory()
  print(f"process {i} of {n} holds {held / 1e6:,.1f} MB of params on {len(mesh.local_devices)} device(s); "
        f"host RSS {before['rss'] / 1e6:,.1f} MB", flush=True)
  while turns and i and not os.path.exists(os.path.join(turns, f"done_{i - 1}")):
    time.sleep(0.5)
  t0 = time.perf_counter()
  with jax.set_mesh(mesh), use_rules(model.rules, exp.sharding.allow_uneven):
    params = importer.import_params(model, source, files)
    jax.block_until_ready(params)
  seconds, in_place = time.perf_counter() - t0, importer.host_memory()
  on_devices = sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)
  if on_devices != held:
    raise RuntimeError(f"{on_devices} bytes of params on this process's devices, {held} expected")
  print(f"imported {source} in {seconds:.2f}s (params only); process {i} of {n} read {files.bytes_read:,} "
        f"of the checkpoint's {files.nbytes:,} bytes; host peak RSS {in_place['peak'] / 1e6:,.1f} MB with the "
        f"params in place", flush=True)
  if turns:
    del params
    gc.collect()
    print(f"host RSS {importer.host_memory()['rss'] / 1e6:,.1f} MB with the params freed", flush=True)
    open(os.path.join(turns, f"done_{i}"), "w").close()


def figures(log: str) -> dict:
  """The figures the import's two lines print (MB -> bytes)."""
  mb = lambda s: float(s.replace(",", "")) * 1e6
  a = re.search(r"holds ([\d,.]+) MB of params on (\d+) device\(s\); host RSS ([\d,.]+) MB", log)
  b = re.search(r"in ([\d.]+)s .* read ([\d,]+) of the checkpoint's ([\d,]+) bytes; host peak RSS ([\d,.]+) MB "
                r"with the params in place(?:, ([\d,.]+) MB after the save)?", log)
  if not (a and b):
    raise RuntimeError(f"no import figures in the log:\n{log[-3000:]}")
  return {"held": mb(a.group(1)), "rss_before": mb(a.group(3)), "seconds": float(b.group(1)),
          "read": int(b.group(2).replace(",", "")), "peak_params": mb(b.group(4)),
          "peak": mb(b.group(5)) if b.group(5) else None}


def run_import(model: str, root: str, n: int, devices: int, rules: str, nice: int,
               params_only: bool = False, in_turn: bool = False) -> list[dict]:
  """Imports `model` in `n` processes; per process its figures and the kernel's ru_maxrss."""
  job = os.path.join(root, f"job_{n}x{devices}_{rules}")
  shutil.rmtree(job, ignore_errors=True)
  if in_turn:
    os.makedirs(job)   # where the processes leave their done_i
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("XLA_FLAGS", None)
  port = free_port()
  procs = []
  for i in range(n):
    log = open(os.path.join(root, f"import_{n}_{i}.log"), "w")
    procs.append((subprocess.Popen(command(model, job, n, devices, rules, port, i, nice, params_only, in_turn), stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=root), log))
  out = []
  for i, (p, log) in enumerate(procs):
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    log.close()
    text = open(log.name).read()
    if p.returncode != 0:
      for q, _ in procs:
        q.kill()
      raise RuntimeError(f"process {i} of {n} exited {p.returncode}:\n{text[-3000:]}")
    out.append({**figures(text), "maxrss": usage.ru_maxrss * 1024})
  shutil.rmtree(job, ignore_errors=True)
  return out


def table(ckpt: int, n: int, devices: int, rules: str, rows: list[dict], in_turn: bool = False) -> str:
  gb = lambda x: f"{x / 1e9:.2f}"
  saved = rows[0]["peak"] is not None
  total = sum(r["peak_params"] for r in rows)
  lines = [f"{n} process(es) x {devices} CPU device(s), `{rules}` rules, checkpoint {gb(ckpt)} GB (GB = 1e9 bytes)"
           f"{'' if saved else ', params only (no optimizer init, no save)'}"
           f"{', importing one process at a time' if in_turn else ''}; the processes' peaks with the params "
           f"in place add up to {gb(total)} GB, the largest is {max(r['peak_params'] for r in rows) / ckpt:.0%} "
           f"of the checkpoint:", "",
           "| process | params on its devices | read | RSS before | peak, params in place | peak - before "
           "| peak after the save (ru_maxrss) | import s |", "|---|---|---|---|---|---|---|---|"]
  for i, r in enumerate(rows):
    lines.append(f"| {i} | {gb(r['held'])} | {gb(r['read'])} | {gb(r['rss_before'])} | {gb(r['peak_params'])} | "
                 f"{gb(r['peak_params'] - r['rss_before'])} | {gb(r['peak']) if saved else 'not run'} "
                 f"({gb(r['maxrss'])}) | {r['seconds']:.0f} |")
  return "\n".join(lines)


def machine() -> str:
  with open("/proc/meminfo") as f:
    total = int(f.readline().split()[1]) * 1024
  return f"{platform.machine()}, {os.cpu_count()} cores, {total / 2**30:.0f} GiB RAM, {platform.system()} {platform.release()}"


def main() -> None:
  if sys.argv[1:2] == ["--child"]:   # one process of a --params-only run (command())
    source, n, devices, rules, port, i, turns = sys.argv[2:]
    return params_only_child(source, int(n), int(devices), rules, int(port), int(i), turns)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=32)
  ap.add_argument("--processes", default="4", help="comma-separated process counts, run in turn")
  ap.add_argument("--devices", type=int, default=2, help="CPU devices per process")
  ap.add_argument("--rules", choices=sorted(RULES), default="fsdp")
  ap.add_argument("--dir", default="/tmp/hf_import_memory")
  ap.add_argument("--nice", type=int, default=10)
  ap.add_argument("--params-only", action="store_true",
                  help="stop once the params are in place: no optimizer init, no save of step 0")
  ap.add_argument("--in-turn", action="store_true",
                  help="with --params-only: the processes import one at a time, each freeing its params after")
  ap.add_argument("--keep", action="store_true", help="keep the written checkpoint (for another run)")
  ap.add_argument("--force", action="store_true", help="run even with less available than the run asks for")
  ap.add_argument("--results", help="append the figures to this markdown file")
  args = ap.parse_args()
  if args.in_turn and not args.params_only:
    ap.error("--in-turn needs --params-only (the save of step 0 is collective: every process at once)")
  model = os.path.join(args.dir, f"llama2_7b_shape_{args.layers}l")
  os.makedirs(args.dir, exist_ok=True)
  ckpt = write_checkpoint(model, args.layers)
  load = f"load average {os.getloadavg()[0]:.2f}, MemAvailable {mem_available() / 1e9:.1f} GB at the start"
  sections = []
  for n in [int(x) for x in args.processes.split(",")]:
    need, asks = need_bytes(ckpt, args.layers, n, args.params_only, args.in_turn)
    if mem_available() < asks and not args.force:
      raise SystemExit(f"{n} processes need ~{need / 1e9:.1f} GB together; this run asks for {asks / 1e9:.1f} GB "
                       f"available and {mem_available() / 1e9:.1f} GB is: fewer --layers, --params-only, or --force")
    rows = run_import(model, args.dir, n, args.devices, args.rules, args.nice, args.params_only, args.in_turn)
    sections.append(table(ckpt, n, args.devices, args.rules, rows, args.in_turn))
    print(sections[-1], flush=True)
  if not args.keep:
    shutil.rmtree(model, ignore_errors=True)
  if args.results:
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "trainer/hf", "models/hf",
                            "benchmarks/hf_import_memory.py"],
                           capture_output=True, text=True).stdout.strip()
    head = (f"## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {commit}"
            f"{' (+ local changes)' if dirty else ''}\n\n`{' '.join(['python', *sys.argv])}`  \n"
            f"machine: {machine()}; this script's own peak RSS "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB; {load}\n")
    with open(args.results, "a") as f:
      f.write("\n" + head + "\n" + "\n\n".join(sections) + "\n")


if __name__ == "__main__":
  main()
