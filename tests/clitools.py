"""Running the real `shardax` command line from tests: real processes, signals and files."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

TINY = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.d_ff=128",
        "model.max_len=32", "data.seq_len=32", "train.global_batch=8", "train.log_every=1",
        "train.eval_every=1000", "train.eval_batches=1", "optimizer.warmup_steps=2"]


def env(devices: int = 1) -> dict:
  e = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="3")
  e.pop("XLA_FLAGS", None)
  return e


def command(job_dir, data_dir, *sets, exp="lm.tiny", mode="train", extra=()):
  args = [sys.executable, "-m", "shardax.main", f"--exp={exp}", f"--job_dir={job_dir}", f"--mode={mode}"]
  for s in (*TINY, f"data.data_dir={str(data_dir)!r}", *sets):
    args += ["--set", s]
  return args + list(extra)


def run(args, devices=1, timeout=240):
  return subprocess.run(args, capture_output=True, text=True, env=env(devices), timeout=timeout)


def start(args, devices=1, log=None):
  out = open(log, "w") if log else subprocess.DEVNULL
  return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env(devices))


def wait_or_kill(proc, timeout):
  """The exit status, or kill the process (and fail the test) when it overruns `timeout`."""
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
    raise


def losses(job_dir) -> dict[int, float]:
  path = os.path.join(job_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return {}
  out = {}
  for line in open(path):
    row = json.loads(line)
    if "loss" in row:
      out[row["step"]] = row["loss"]
  return out


def wait_for(predicate, timeout=180, poll=0.02):
  end = time.time() + timeout
  while time.time() < end:
    if predicate():
      return True
    time.sleep(poll)
  return False


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def checkpoint_steps(job_dir) -> list[int]:
  d = os.path.join(job_dir, "checkpoints")
  return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def snapshot(path) -> dict[str, tuple[int, float]]:
  """Every file under `path` with its size and mtime: to prove nothing was written."""
  out = {}
  for root, _, files in os.walk(path):
    for f in files:
      p = os.path.join(root, f)
      st = os.stat(p)
      out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns)
  return out


SIGTERM, SIGKILL = signal.SIGTERM, signal.SIGKILL
