"""Faults in a two-process job (real processes, real signals, 4 CPU devices each):
a pod-wide SIGTERM (maintenance event) and one process SIGKILLed (a host lost)."""

import json
import os
import subprocess
import time

import numpy as np
import pytest

import clitools as cli
from test_cloud import BUCKET, emulator  # noqa: F401  (the local GCS emulator fixture, reused)

# The schedule must not depend on train.steps, which differs between a run and its resumption.
SCHEDULE = "optimizer.decay_steps=1000"
MESH = ["mesh.dcn=(2, 1)", "mesh.ici=(1, 4)", "sharding.preset='2d'", "mesh.num_cpu_devices=4", SCHEDULE]


def start_two(job, data_dir, tmp_path, *sets, extra=(), tag="run"):
  port = cli.free_port()
  return [cli.start(cli.command(job, data_dir, *MESH, *sets,
                                extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                       f"--process_id={i}", *extra]),
                    devices=4, log=tmp_path / f"{tag}{i}.log") for i in range(2)]


def logs(tmp_path, tag):
  return "\n".join(open(tmp_path / f"{tag}{i}.log").read()[-2500:] for i in range(2))


def finish_two(job, data_dir, tmp_path, steps):
  procs = start_two(job, data_dir, tmp_path, f"train.steps={steps}", "checkpoint.every=100", tag="resume")
  assert [cli.wait_or_kill(p, timeout=300) for p in procs] == [0, 0], logs(tmp_path, "resume")
  return open(tmp_path / "resume0.log").read()


def reference_losses(tmp_path, data_dir, steps, *sets):
  """The same (2, 4) mesh in one process with 8 devices, uninterrupted."""
  job = tmp_path / "ref"
  out = cli.run(cli.command(job, data_dir, "mesh.ici=(2, 4)", "sharding.preset='2d'", "mesh.num_cpu_devices=8",
                            SCHEDULE, f"train.steps={steps}", "checkpoint.every=100", *sets), devices=8)
  assert out.returncode == 0, out.stderr[-3000:]
  return cli.losses(job)


def test_sigterm_to_every_process_saves_one_step_and_resumes_the_curve(tmp_path):
  data_dir, job = tmp_path / "data", tmp_path / "job"
  procs = start_two(job, data_dir, tmp_path, "train.steps=1000", "checkpoint.every=100")
  try:
    assert cli.wait_for(lambda: max(cli.losses(job), default=0) >= 4, timeout=300), logs(tmp_path, "run")
    for p in procs:
      p.send_signal(cli.SIGTERM)
    assert [cli.wait_or_kill(p, timeout=120) for p in procs] == [0, 0], logs(tmp_path, "run")
  finally:
    for p in procs:
      p.kill()
  saved = cli.checkpoint_steps(job)
  assert len(saved) == 1 and 4 <= saved[0] < 100, saved   # one agreed step, not a periodic one
  stopped = saved[0]
  log = finish_two(job, data_dir, tmp_path, stopped + 3)
  assert f"resumed from step {stopped}" in log
  for i in range(2):   # each process resumed its own readers: nothing read twice
    assert (f"process {i} restored its data state at step {stopped}, 0 batches replayed"
            in open(tmp_path / f"resume{i}.log").read())
  got, ref = cli.losses(job), reference_losses(tmp_path, data_dir, stopped + 3)
  steps = range(stopped + 1, stopped + 4)
  np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


def test_a_process_that_loses_its_peer_exits_within_the_bound_and_restart_resumes(tmp_path):
  data_dir, job = tmp_path / "data", tmp_path / "job"
  bound = 5
  procs = start_two(job, data_dir, tmp_path, "train.steps=100000", "checkpoint.every=3",
                    extra=[f"--heartbeat_timeout_s={bound}"])
  try:
    assert cli.wait_for(lambda: cli.checkpoint_steps(job), timeout=300), logs(tmp_path, "run")
    procs[1].kill()
    killed = time.monotonic()
    code = cli.wait_or_kill(procs[0], timeout=bound + 60)
    took = time.monotonic() - killed
  finally:
    for p in procs:
      p.kill()
  assert code != 0, logs(tmp_path, "run")
  assert took < bound + 30, f"survivor took {took:.0f}s to exit"
  complete = cli.checkpoint_steps(job)
  log = finish_two(job, data_dir, tmp_path, complete[-1] + 2)
  assert f"resumed from step {complete[-1]}" in log
  assert not [n for n in os.listdir(job / "checkpoints") if "tmp" in n]


MESH4 = ["mesh.dcn=(2, 1)", "mesh.ici=(1, 4)", "sharding.preset='2d'", "mesh.num_cpu_devices=2", SCHEDULE]


def start_four_on_two_hosts(job, data_dir, tmp_path, *sets, tag):
  """4 processes x 2 CPU devices; SHARDAX_NODE_ID fakes 2 hosts of 2 processes each."""
  port = cli.free_port()
  return [subprocess.Popen(
      cli.command(job, data_dir, *MESH4, *sets, extra=[f"--coordinator_address=127.0.0.1:{port}",
                                                       "--num_processes=4", f"--process_id={i}"]),
      stdout=open(tmp_path / f"{tag}{i}.log", "w"), stderr=subprocess.STDOUT,
      env=dict(cli.env(2), SHARDAX_NODE_ID=str(i // 2))) for i in range(4)]


@pytest.mark.slow
def test_four_processes_on_two_hosts_resume_their_own_data_state(tmp_path, emulator):
  """A folder of JSONL files in a bucket, prepared into a gs:// data dir (the local GCS
  emulator); mesh.dcn=(2, 1) over 2 faked hosts of 2 processes (4 processes would be 4
  granules without node ids, and the run would refuse); SIGTERM mid-run; each process
  resumes its own data state with nothing replayed; the losses are the uninterrupted
  8-device run's."""
  _, fs = emulator
  for f in range(2):
    fs.pipe(f"{BUCKET}/corpus/part{f}.jsonl", "".join(
        json.dumps({"text": f"document {f}.{i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(60))}) + "\n"
        for i in range(300)).encode())
  data_dir, job = f"gs://{BUCKET}/data", tmp_path / "job"
  source = f"data.source='files:gs://{BUCKET}/corpus/*.jsonl'"
  procs = start_four_on_two_hosts(job, data_dir, tmp_path, "train.steps=1000", "checkpoint.every=100", source,
                                  tag="run")
  read = lambda tag: "\n".join(open(tmp_path / f"{tag}{i}.log").read()[-2000:] for i in range(4))  # noqa: E731
  try:
    assert cli.wait_for(lambda: max(cli.losses(job), default=0) >= 4, timeout=400), read("run")
    for p in procs:
      p.send_signal(cli.SIGTERM)
    assert [cli.wait_or_kill(p, timeout=180) for p in procs] == [0] * 4, read("run")
  finally:
    for p in procs:
      p.kill()
  assert "processes by host (from node ids): {0: 0, 1: 0, 2: 1, 3: 1}" in open(tmp_path / "run0.log").read()
  [stopped] = cli.checkpoint_steps(job)
  procs = start_four_on_two_hosts(job, data_dir, tmp_path, f"train.steps={stopped + 3}", "checkpoint.every=100",
                                  source, tag="resume")
  assert [cli.wait_or_kill(p, timeout=400) for p in procs] == [0] * 4, read("resume")
  for i in range(4):
    assert (f"process {i} restored its data state at step {stopped}, 0 batches replayed"
            in open(tmp_path / f"resume{i}.log").read()), read("resume")
  got, ref = cli.losses(job), reference_losses(tmp_path, data_dir, stopped + 3, source)
  steps = range(stopped + 1, stopped + 4)
  np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=1e-5)
