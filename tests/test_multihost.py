"""Two real processes on localhost, 4 simulated CPU devices each, one (2, 4) mesh over both.

jax.distributed joins them; the batch's data axis spans the processes, each loads only
its rows, and XLA's collectives (gloo on CPU) cross the process boundary. The run must
match a one-process, 8-device run, and checkpoints must move between the two layouts.
Each process is one DCN granule: `mesh.dcn x mesh.ici` builds the same (2, 4) mesh
with the data axis (or the model axis) split across the processes.

The data is a mixture of two sources prepared into ONE shard file each, so there is one
reader (gcd(1, batch 8)) and each of two processes holds half its rows: the layout that
used to give each process a reader of its own (other batches than one process) and a
replay on resume. Every run records the documents it consumes (SHARDAX_RECORD_DOCUMENTS).
"""

import contextlib
import json
import os
import shutil

import numpy as np
import pytest

import clitools as cli
from shardax.trainer.data import record

MESH = ["mesh.ici=(2, 4)", "sharding.preset='2d'"]
DCN_DATA = ["mesh.dcn=(2, 1)", "mesh.ici=(1, 4)", "sharding.preset='2d'"]  # the same (2, 4) mesh


def write_mixture(root) -> list[str]:
  """Two JSON-lines sources (documents starting 'A' / 'B') mixed 0.7 / 0.3, one shard each."""
  srcs = []
  for letter, n in (("A", 150), ("B", 100)):
    if not (root / letter).exists():   # written once: a rewrite would change the fingerprint
      os.makedirs(root / letter)
      with open(root / letter / "part.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"{letter}{i} " + "tok " * (i % 23)}) + "\n" for i in range(n))
    srcs.append(f"files:{root / letter}/*.jsonl")
  return [f"data.mixture=(({srcs[0]!r}, 0.7), ({srcs[1]!r}, 0.3))", "data.num_shards=1",
          "data.validation_fraction=0.2"]


@contextlib.contextmanager
def recording(job):
  """Runs launched inside record their documents into the job dir."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(record.ENV, str(job))
    yield


def two_processes(job, data_dir, *sets, tmp_path, mesh=MESH):
  sets = (*write_mixture(data_dir), *sets)
  port = cli.free_port()
  with recording(job):
    procs = [cli.start(cli.command(job, data_dir, *mesh, "mesh.num_cpu_devices=4", *sets,
                                   extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                          f"--process_id={i}"]),
                       devices=4, log=tmp_path / f"proc{i}.log") for i in range(2)]
  codes = [cli.wait_or_kill(p, timeout=300) for p in procs]
  logs = [open(tmp_path / f"proc{i}.log").read() for i in range(2)]
  assert codes == [0, 0], "\n".join(l[-2000:] for l in logs)
  return logs


def one_process(job, data_dir, *sets):
  with recording(job):
    out = cli.run(cli.command(job, data_dir, *MESH, "mesh.num_cpu_devices=8", *write_mixture(data_dir), *sets),
                  devices=8)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("data")
  multi, single = tmp_path_factory.mktemp("multi"), tmp_path_factory.mktemp("single")
  logs = two_processes(multi, data_dir, "train.steps=6", "checkpoint.every=3",
                       tmp_path=tmp_path_factory.mktemp("logs"), mesh=DCN_DATA)
  one_process(single, data_dir, "train.steps=6", "checkpoint.every=3")
  return data_dir, multi, single, logs


def test_two_processes_match_one_process(runs):
  """Data axis over DCN (one granule per process), model axis inside each: the (2, 4) run's losses."""
  _, multi, single, logs = runs
  assert "process 1 of 2" in logs[1] or "process 1 of 2" in logs[0]
  a, b = cli.losses(multi), cli.losses(single)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)
  assert cli.checkpoint_steps(multi) == cli.checkpoint_steps(single) == [3, 6]


def test_two_processes_read_the_one_process_documents(runs):
  """Each step's document pieces (source, index, tokens) over the global batch: the same
  on two processes as on one, and both sources drawn."""
  _, multi, single, _ = runs
  one, two = record.steps(single), record.steps(multi)
  assert sorted(one) == [1, 2, 3, 4, 5, 6] and two == one
  assert {s for pieces in one.values() for s, _, _ in pieces} == {0, 1}


def resume_from_step_3(job, source):
  """A copy of `source` whose newest checkpoint is step 3, with no document record yet."""
  shutil.copytree(source, job)
  shutil.rmtree(job / "checkpoints" / "6")
  shutil.rmtree(job / "documents")


def test_checkpoints_move_between_one_and_two_processes(runs, tmp_path):
  """2 -> 1 and 1 -> 2 processes from step 3: steps 4-6 take exactly the documents and
  give the losses of the uninterrupted run (nothing replayed, nothing skipped)."""
  data_dir, multi, single, _ = runs
  whole = record.steps(single)
  # Two-process checkpoint, resumed by one process ...
  a = tmp_path / "a"
  resume_from_step_3(a, multi)
  out = one_process(a, data_dir, "train.steps=6", "checkpoint.every=3")
  assert "resumed from step 3" in out.stderr
  # it rebuilt its reader from both processes' saved states: nothing read twice
  assert "process 0 restored its data state at step 3, 0 batches replayed" in out.stderr
  # ... and one-process checkpoint, resumed by two processes.
  b = tmp_path / "b"
  resume_from_step_3(b, single)
  logs = two_processes(b, data_dir, "train.steps=6", "checkpoint.every=3", tmp_path=tmp_path)
  for i, log in enumerate(logs):
    assert f"process {i} restored its data state at step 3, 0 batches replayed" in log
  for job in (a, b):
    assert record.steps(job) == {s: whole[s] for s in (4, 5, 6)}
    got, want = cli.losses(job), cli.losses(single)
    np.testing.assert_allclose([got[s] for s in (4, 5, 6)], [want[s] for s in (4, 5, 6)], rtol=1e-5)


def test_dcn_on_the_model_axis_matches_one_process(runs, tmp_path):
  """The model axis split across the two processes (DCN), data inside each: still the (2, 4) run."""
  data_dir, _, single, _ = runs
  mesh = ["mesh.dcn=(1, 2)", "mesh.ici=(2, 2)", "sharding.preset='2d'"]
  two_processes(tmp_path / "job", data_dir, "train.steps=6", "checkpoint.every=3", tmp_path=tmp_path, mesh=mesh)
  a, b = cli.losses(tmp_path / "job"), cli.losses(single)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([a[s] for s in a], [b[s] for s in a], rtol=1e-5)


def test_dcn_names_the_granules_found(runs, tmp_path):
  """One process is one granule: asking for two over DCN fails with the count found."""
  data_dir = runs[0]
  out = cli.run(cli.command(tmp_path / "job", data_dir, "mesh.num_cpu_devices=8", "mesh.dcn=(2, 1)",
                            "mesh.ici=(1, 4)"), devices=8)
  assert out.returncode == 2
  assert "mesh.dcn=(2, 1) needs 2 granules (hosts joined by DCN), 1 host found" in out.stderr


def test_processes_that_see_different_checkpoints_stop_naming_each_step(runs, tmp_path):
  """Each process restores the step an all-gather agreed on; here process 1 reads a job dir
  whose newest step is 3 (not shared storage): both stop, naming the step each one saw."""
  data_dir, multi, _, _ = runs
  for name in ("a", "b"):
    shutil.copytree(multi, tmp_path / name)
  shutil.move(tmp_path / "b" / "checkpoints" / "6", tmp_path / "b-step6")
  port = cli.free_port()
  procs = [cli.start(cli.command(tmp_path / job, data_dir, *DCN_DATA, "mesh.num_cpu_devices=4",
                                 *write_mixture(data_dir), "train.steps=8",
                                 "checkpoint.every=3",
                                 extra=[f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                                        f"--process_id={i}"]),
                     devices=4, log=tmp_path / f"p{i}.log") for i, job in enumerate(("a", "b"))]
  codes = [cli.wait_or_kill(p, timeout=300) for p in procs]
  logs = [open(tmp_path / f"p{i}.log").read() for i in range(2)]
  assert codes == [2, 2], "\n".join(l[-2000:] for l in logs)
  for log in logs:
    assert "the processes see different newest checkpoints" in log and "process 0: step 6, process 1: step 3" in log
