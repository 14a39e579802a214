"""Restarts from the local checkpoint tier (trainer/local_tier.py) with real processes and
SIGKILL: the losses continue exactly from the newest local step every process holds; a
wiped local dir or an incomplete step on one host is never restored; a job dir deleted and
made again, or rolled back to an older persistent step, is never handed the old local
steps; a clean finish leaves no local copies."""

import glob
import os
import shutil

import numpy as np
import pytest

import clitools as cli
from test_multihost_faults import SCHEDULE, logs, start_two

MARKER = "COMPLETE"


def tier_sets(local):
  return [f"checkpoint.local_dir={str(local)!r}", "checkpoint.local_every=2"]


def held(local) -> list[list[int]]:
  """Each process's complete local steps (process 0 first)."""
  dirs = sorted(glob.glob(os.path.join(local, "shardax-*", "process_*")))
  return [sorted(int(s) for s in os.listdir(d) if s.isdigit() and os.path.exists(os.path.join(d, s, MARKER)))
          for d in dirs]


def kill_when(job, procs, step, victim, tmp_path, tag):
  try:
    assert cli.wait_for(lambda: max(cli.losses(job), default=0) >= step, timeout=400), logs(tmp_path, tag)
  finally:
    procs[victim].kill()
    for p in procs:
      try:
        p.wait(timeout=120)   # the survivor stops on its heartbeat timeout
      finally:
        p.kill()


def left_behind(tmp_path, ready, *sets):
  """(job dir, local dir, args(steps)) after a run SIGKILLed once `ready(job, local)`."""
  data_dir, job, local = tmp_path / "data", tmp_path / "job", tmp_path / "local"
  args = lambda steps: cli.command(job, data_dir, f"train.steps={steps}", SCHEDULE,  # noqa: E731
                                   *tier_sets(local), *sets)
  proc = cli.start(args(1000), log=tmp_path / "run.log")
  try:
    assert cli.wait_for(lambda: ready(job, local), timeout=400), open(tmp_path / "run.log").read()[-3000:]
  finally:
    proc.kill()
    proc.wait()
  return job, local, args


def test_one_process_resumes_from_its_local_step(tmp_path):
  data_dir, job, local = tmp_path / "data", tmp_path / "job", tmp_path / "local"
  args = lambda steps: cli.command(job, data_dir, f"train.steps={steps}", "checkpoint.every=100",  # noqa: E731
                                   SCHEDULE, *tier_sets(local))
  proc = cli.start(args(1000), log=tmp_path / "run.log")
  kill_when(job, [proc], 5, 0, tmp_path, "run")
  before = cli.losses(job)
  [steps] = held(local)
  assert steps and max(steps) < max(before), (steps, before)   # killed past its newest local step
  out = cli.run(args(max(before) + 1))
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"restore: local tier, step {steps[-1]}" in out.stderr, out.stderr[-3000:]
  after = cli.losses(job)
  redone = range(steps[-1] + 1, max(before) + 1)   # steps the killed run had logged
  np.testing.assert_allclose([after[s] for s in redone], [before[s] for s in redone], rtol=1e-6)
  assert os.listdir(local) == [], os.listdir(local)   # finished: no local copy is left behind


def test_a_deleted_and_recreated_job_dir_starts_fresh(tmp_path):
  """Identity rule: the killed run saved no persistent step, so only the job dir's identity
  tells its local steps from a new job's at the same path."""
  job, local, args = left_behind(tmp_path, lambda job, local: held(local) and held(local)[0],
                                 "checkpoint.every=100")
  [steps] = held(local)
  assert steps and not cli.checkpoint_steps(job), (steps, cli.checkpoint_steps(job))
  shutil.rmtree(job)
  out = cli.run(args(2))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "restore: no checkpoint in either tier (identity rule: local step(s) " in out.stderr, out.stderr[-3000:]
  assert "resumed from step" not in out.stderr and sorted(cli.losses(job)) == [1, 2], out.stderr[-3000:]


def test_a_rolled_back_persistent_tier_is_not_rolled_forward(tmp_path):
  """History rule: the user deletes the persistent steps after 4; the local steps written
  after them must not bring that history back."""
  def ready(job, local):   # every local step is newer than a committed persistent step after 4
    persistent, mine = cli.checkpoint_steps(job), held(local)
    return len(persistent) > 1 and mine and mine[0] and mine[0][0] > persistent[1]
  job, local, args = left_behind(tmp_path, ready, "checkpoint.every=4", "checkpoint.keep=10")
  [steps], persistent, before = held(local), cli.checkpoint_steps(job), cli.losses(job)
  assert persistent[0] == 4 and len(persistent) > 1 and steps and steps[0] > 4, (steps, persistent)
  for step in persistent[1:]:
    shutil.rmtree(job / "checkpoints" / str(step))
  out = cli.run(args(5))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "restore: persistent tier, step 4: history rule: local step(s) " in out.stderr, out.stderr[-3000:]
  assert "resumed from step 4" in out.stderr, out.stderr[-3000:]
  np.testing.assert_allclose(cli.losses(job)[5], before[5], rtol=1e-6)   # step 5 again, from step 4


@pytest.mark.slow
def test_two_processes_restart_from_the_newest_local_step_all_hold(tmp_path):
  """One SIGKILL between persistent saves, then three restarts of the same moment: as left
  (local tier, exact losses), with one host's local dir wiped (persistent tier), and with
  the newest step incomplete on one host (the step before it)."""
  data_dir, job, local = tmp_path / "data", tmp_path / "job", tmp_path / "local"
  sets = ["checkpoint.every=6", *tier_sets(local)]
  procs = start_two(job, data_dir, tmp_path, "train.steps=1000", *sets, extra=["--heartbeat_timeout_s=5"])
  kill_when(job, procs, 11, 1, tmp_path, "run")
  before, persistent = cli.losses(job), cli.checkpoint_steps(job)[-1]
  both = sorted(set(held(local)[0]) & set(held(local)[1]))
  assert len(held(local)) == 2 and both and both[-1] > persistent, (held(local), persistent)
  snap = tmp_path / "snap"
  shutil.copytree(job, snap / "job")
  shutil.copytree(local, snap / "local")

  def restart(tag, expect):
    for src, dst in ((snap / "job", job), (snap / "local", local)):
      shutil.rmtree(dst)
      shutil.copytree(src, dst)
    yield   # the caller damages the copy here
    procs = start_two(job, data_dir, tmp_path, f"train.steps={max(before) + 1}", *sets, tag=tag)
    assert [cli.wait_or_kill(p, timeout=400) for p in procs] == [0, 0], logs(tmp_path, tag)
    log = open(tmp_path / f"{tag}0.log").read()
    assert expect in log, logs(tmp_path, tag)
    after = cli.losses(job)
    step = int(expect.split("step ")[1].split(":")[0])
    redone = range(step + 1, max(before) + 1)
    np.testing.assert_allclose([after[s] for s in redone], [before[s] for s in redone], rtol=1e-5)
    yield

  run = restart("asleft", f"restore: local tier, step {both[-1]}:")
  next(run), next(run)
  expect = f"restore: persistent tier, step {persistent}: process(es) [1] hold no complete local step"
  run = restart("wiped", expect)
  next(run)   # (the run before finished cleanly and removed its local copies: these are the snapshot's)
  [wiped] = glob.glob(str(local / "shardax-*" / "process_1-of-2"))
  shutil.rmtree(wiped)
  next(run)
  older = [s for s in both[:-1] if s > persistent]
  expect = (f"restore: local tier, step {older[-1]}:" if older else f"restore: persistent tier, step {persistent}:")
  run = restart("incomplete", expect)
  next(run)
  os.remove(glob.glob(str(local / "shardax-*" / "process_0-of-2" / str(both[-1]) / MARKER))[0])
  next(run)
