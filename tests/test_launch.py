"""Launches that fail loudly: a cluster detection that raises, a job dir leased by another
live job, processes with different configs; and hosts (not processes) as DCN granules."""

import json
import os
import socket
import sys
import time

import pytest

import clitools as cli
from shardax.sharding import mesh as mesh_lib
from shardax.trainer import distributed, jobdir

try:   # the gs:// emulator fixture, where the test extra is installed
  from test_cloud import BUCKET, emulator  # noqa: F401
except pytest.skip.Exception:
  BUCKET = emulator = None

# A SLURM step whose task count is garbled: jax's detection raises on it.
BROKEN_SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "two",
                "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def test_a_failed_detection_exits_non_zero_with_the_cause(tmp_path):
  env = dict(cli.env(), **BROKEN_SLURM)
  out = __import__("subprocess").run(cli.command(tmp_path / "job", tmp_path / "data", "train.steps=1"),
                                     capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  assert "cluster detection SlurmCluster failed (ValueError" in out.stderr and "--single_process" in out.stderr
  assert not (tmp_path / "job").exists()


def test_single_process_runs_alone_despite_a_broken_launcher(monkeypatch):
  for k, v in BROKEN_SLURM.items():
    monkeypatch.setenv(k, v)
  with pytest.raises(distributed.LaunchError, match="SlurmCluster"):
    distributed.detected_cluster()
  assert distributed.detected_cluster(single_process=True) is None
  assert distributed.initialize(single_process=True) is None


def test_a_live_lease_refuses_a_second_job_and_names_the_holder(tmp_path):
  first = jobdir.Lease(tmp_path, heartbeat_s=0.05).acquire()
  try:
    lease = json.loads((tmp_path / jobdir.LEASE_FILE).read_text())
    time.sleep(0.2)
    assert json.loads((tmp_path / jobdir.LEASE_FILE).read_text())["heartbeat"] > lease["heartbeat"]
    with pytest.raises(jobdir.LeaseError, match=rf"in use by another live job: host {socket.gethostname()} "
                                                rf"\(pid {os.getpid()}\), started 20\d\d-"):
      jobdir.Lease(tmp_path).acquire()
    # Any process of the second job seeing it refuses the whole job.
    with pytest.raises(jobdir.LeaseError):
      jobdir.Lease(tmp_path, any_process=lambda flag: True).acquire()
  finally:
    first.release()
  assert not (tmp_path / jobdir.LEASE_FILE).exists()
  jobdir.Lease(tmp_path).acquire().release()   # free again
  jobdir.Lease(tmp_path / "new").acquire().release()
  assert not (tmp_path / "new").exists()   # a job dir the lease made and the job left empty goes


def _race(job_dir, n=8):
  """`n` threads acquire one job dir's lease at the same instant: (winners, refusal messages)."""
  import threading
  barrier, won, refused = threading.Barrier(n), [], []

  def attempt():
    lease = jobdir.Lease(job_dir)
    barrier.wait()
    try:
      won.append(lease.acquire())
    except jobdir.LeaseError as e:
      refused.append(str(e))
  threads = [threading.Thread(target=attempt) for _ in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  return won, refused


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh_job_dir", "dead_holder"])
def test_racing_acquirers_leave_exactly_one_holder(tmp_path, monkeypatch, fresh):
  """The lease is created atomically: of eight racers exactly one wins, on a fresh job dir
  (the directory does not even exist yet) and when they take over a dead job's lease.
  Reads are slowed (a slow store) so that a check-then-write would let them all through."""
  read = jobdir.Lease.read
  monkeypatch.setattr(jobdir.Lease, "read", lambda self: (read(self), time.sleep(0.05))[0])
  job = tmp_path / "job"   # fresh: not even the directory exists yet
  if not fresh:
    jobdir.write_text(job / jobdir.LEASE_FILE, json.dumps(
        {"id": "dead", "host": "gone-host", "pid": 1, "start": 0, "heartbeat": time.time() - 600}))
  won, refused = _race(job)
  try:
    assert len(won) == 1 and len(refused) == 7, (len(won), refused)
    assert all(f"in use by another live job: host {socket.gethostname()} (pid {os.getpid()})" in m
               for m in refused), refused
    assert json.loads((job / jobdir.LEASE_FILE).read_text())["id"] == won[0].record["id"]
  finally:
    for lease in won:
      lease.release()
  assert not (job / jobdir.LEASE_FILE).exists() and not list(job.glob("*takeover*"))


def test_a_holder_that_lost_its_lease_does_not_overwrite_the_new_one(tmp_path):
  first = jobdir.Lease(tmp_path, heartbeat_s=0.05).acquire()
  try:
    taken = dict(first.record, id="other", host="other-host", heartbeat=time.time())
    jobdir.write_text(tmp_path / jobdir.LEASE_FILE, json.dumps(taken))
    time.sleep(0.3)
    assert json.loads((tmp_path / jobdir.LEASE_FILE).read_text()) == taken
  finally:
    first.release()
  assert json.loads((tmp_path / jobdir.LEASE_FILE).read_text()) == taken   # not ours to remove


def test_dead_or_silent_holders_free_the_job_dir(tmp_path):
  now = time.time()
  dead_here = {"id": "x", "host": socket.gethostname(), "pid": 2**22 + 12345, "start": now, "heartbeat": now}
  silent_elsewhere = {"id": "y", "host": "other-host", "pid": 1, "start": now - 600, "heartbeat": now - 120}
  live_elsewhere = dict(silent_elsewhere, heartbeat=now - 5)
  assert jobdir.live_holder(dead_here) is None
  assert jobdir.live_holder(silent_elsewhere) is None
  assert "host other-host (pid 1)" in jobdir.live_holder(live_elsewhere)
  jobdir.write_text(tmp_path / jobdir.LEASE_FILE, json.dumps(live_elsewhere))
  with pytest.raises(jobdir.LeaseError, match="other-host"):
    jobdir.Lease(tmp_path).acquire()


class _Dev:
  platform = "cpu"

  def __init__(self, process_index):
    self.process_index = process_index


def test_node_ids_group_processes_into_hosts_whatever_their_order(monkeypatch):
  """One process per GPU, ranks not node-major: the node ids decide the granule."""
  monkeypatch.setenv("SHARDAX_PROCESSES_PER_HOST", "1")
  try:
    assert mesh_lib.set_node_ids([5, 9, 5, 9]) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert [mesh_lib.granule_of(_Dev(p)) for p in range(4)] == [0, 1, 0, 1]
    kind, groups = mesh_lib.granules([_Dev(p) for p in range(4)])
    assert kind == "host" and [[d.process_index for d in g] for g in groups] == [[0, 2], [1, 3]]
    assert mesh_lib.processes_share_hosts()
    with pytest.raises(ValueError, match=r"processes \[1\] have no node id"):
      mesh_lib.set_node_ids([0, None])
  finally:
    mesh_lib.set_node_ids(None)
  assert [mesh_lib.granule_of(_Dev(p)) for p in range(4)] == [0, 1, 2, 3]   # no ids: one per process
  monkeypatch.setenv("SLURM_NODEID", "3")
  assert mesh_lib.node_id() == 3
  monkeypatch.setenv("SHARDAX_NODE_ID", "1")
  assert mesh_lib.node_id() == 1   # ours wins


def test_processes_with_different_configs_refuse_to_start(tmp_path):
  port = cli.free_port()
  procs = [cli.start(cli.command(tmp_path / "job", tmp_path / "data", f"train.steps={3 + i}",
                                 extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                        f"--process_id={i}"]), log=tmp_path / f"p{i}.log") for i in range(2)]
  codes = [cli.wait_or_kill(p, timeout=180) for p in procs]
  logs = [open(tmp_path / f"p{i}.log").read() for i in range(2)]
  assert codes == [2, 2], logs
  for log in logs:
    assert "the processes hold different configs" in log and "process 0: " in log and "process 1: " in log
  assert not (tmp_path / "job").exists()


def test_a_second_job_on_a_leased_job_dir_is_refused(tmp_path):
  """Real processes: job A trains; job B on the same job dir exits 2 naming A's host and
  pid and writes nothing; A, stopped, frees the lease; a restart resumes."""
  job, data = tmp_path / "job", tmp_path / "data"
  a = cli.start(cli.command(job, data, "train.steps=100000", "checkpoint.every=100000"), log=tmp_path / "a.log")
  try:
    assert cli.wait_for(lambda: cli.losses(job), timeout=180), open(tmp_path / "a.log").read()[-2000:]
    # A keeps appending to its logs and metrics; B must add no file and rewrite no config.
    config = lambda: {k: v for k, v in cli.snapshot(job).items() if k.startswith("config")}  # noqa: E731
    names, before = set(cli.snapshot(job)), config()
    b = cli.run(cli.command(job, data, "train.steps=5"))
    assert b.returncode == 2, b.stderr[-2000:]
    assert (f"is in use by another live job: host {socket.gethostname()} (pid {a.pid}), started "
            in b.stderr), b.stderr[-2000:]
    assert set(cli.snapshot(job)) == names and config() == before
    a.send_signal(cli.SIGTERM)
    assert a.wait(timeout=120) == 0
  finally:
    a.kill()
  assert not (job / jobdir.LEASE_FILE).exists()


# The quickest train run: one step of a one-layer model on synthetic tokens, no checkpoint.
QUICK = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.max_len=16",
         "data.seq_len=16", "train.global_batch=2", "data.source='synthetic'", "train.steps=1",
         "checkpoint.enabled=False"]


@pytest.mark.slow   # ~30 s on a loaded 2-core machine: the winner compiles and trains
def test_two_jobs_started_together_on_a_fresh_job_dir_leave_one_running(tmp_path):
  """Issue 32: both used to run (one job dir, two writers). Now the lease is taken before
  anything else: one trains to the end, the other exits 2 naming the winner's host and pid."""
  job = tmp_path / "job"
  procs = [cli.start(cli.command(job, tmp_path / "data", *QUICK), log=tmp_path / f"{i}.log") for i in range(2)]
  started = time.monotonic()
  codes, seconds = {}, {}
  while len(codes) < 2 and time.monotonic() - started < 240:
    for i, p in enumerate(procs):
      if i not in codes and p.poll() is not None:
        codes[i], seconds[i] = p.returncode, time.monotonic() - started
    time.sleep(0.1)
  for p in procs:
    p.kill()
  logs = [(tmp_path / f"{i}.log").read_text() for i in range(2)]
  assert sorted(codes.values()) == [0, 2], (codes, [log[-1500:] for log in logs])
  winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
  assert (f"in use by another live job: host {socket.gethostname()} (pid {procs[winner].pid}), started "
          in logs[loser]), logs[loser][-1500:]
  assert seconds[loser] < 60 and "done: steps 0 -> 1" in logs[winner]
  assert "two jobs are writing" not in logs[winner]
  assert not (job / jobdir.LEASE_FILE).exists()


def test_import_takes_the_lease(tmp_path):
  """--mode=import writes the job dir: on a leased one it stops before importing anything."""
  fixture = os.path.join(os.path.dirname(__file__), "fixtures", "hf", "llama")
  job = tmp_path / "job"
  with jobdir.Lease(job):
    out = cli.run([sys.executable, "-m", "shardax.main", f"--exp=hf:{fixture}", f"--job_dir={job}", "--mode=import"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"in use by another live job: host {socket.gethostname()} (pid {os.getpid()})" in out.stderr
    assert os.listdir(job) == [jobdir.LEASE_FILE]


@pytest.mark.skipif(emulator is None, reason="the test extra (fake-gcs-server, gcsfs) is not installed")
def test_the_lease_lives_in_a_gs_job_dir(emulator):
  """The lease goes through epath like every job-dir file: on a bucket it refuses too."""
  from etils.epath import gpath
  _, fs = emulator
  url, key = f"gs://{BUCKET}/leased", f"{BUCKET}/leased/{jobdir.LEASE_FILE}"
  gpath._is_tf_installed.cache_clear()   # epath decides its client once: now fsspec (EPATH_USE_TF=false)
  try:
    with jobdir.Lease(url):
      assert fs.exists(key)
      with pytest.raises(jobdir.LeaseError, match=f"host {socket.gethostname()}"):
        jobdir.Lease(url).acquire()
    fs.invalidate_cache()
    assert not fs.exists(key)
  finally:
    gpath._is_tf_installed.cache_clear()


@pytest.mark.skipif(emulator is None, reason="the test extra (fake-gcs-server, gcsfs) is not installed")
def test_racing_acquirers_on_a_gs_job_dir_leave_exactly_one_holder(emulator, monkeypatch):
  """No lock on a bucket: the preconditions (ifGenerationMatch) alone let one racer win, on a
  fresh prefix and over a dead job's lease."""
  from etils.epath import gpath
  _, fs = emulator
  read = jobdir.Lease.read
  monkeypatch.setattr(jobdir.Lease, "read", lambda self: (read(self), time.sleep(0.05))[0])
  gpath._is_tf_installed.cache_clear()
  try:
    for name in ("race-fresh", "race-dead"):
      url = f"gs://{BUCKET}/{name}"
      if name == "race-dead":
        jobdir.write_text(f"{url}/{jobdir.LEASE_FILE}", json.dumps(
            {"id": "dead", "host": "gone-host", "pid": 1, "start": 0, "heartbeat": time.time() - 600}))
      won, refused = _race(url, n=4)
      try:
        assert len(won) == 1 and len(refused) == 3, (name, len(won), refused)
        assert all(f"host {socket.gethostname()} (pid {os.getpid()})" in m for m in refused), refused
        fs.invalidate_cache()
        assert json.loads(fs.cat(f"{BUCKET}/{name}/{jobdir.LEASE_FILE}"))["id"] == won[0].record["id"]
      finally:
        for lease in won:
          lease.release()
  finally:
    gpath._is_tf_installed.cache_clear()
