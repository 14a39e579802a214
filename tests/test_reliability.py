"""Faults on purpose: SIGTERM, SIGKILL mid-save, damaged checkpoints, non-finite steps,
bad input. Real processes, real signals, real files; each bounded in time."""

import os
import shutil

import numpy as np
import pytest

import clitools as cli
from shardax import configs
from shardax.sharding import make_mesh
from shardax.trainer import checkpoint as ckpt_lib
from shardax.trainer.data import inputs
from shardax.trainer import loop, model_setup


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """An uninterrupted 30-step run: the loss curve the faulty runs must reproduce."""
  job = tmp_path_factory.mktemp("ref")
  out = cli.run(cli.command(job, data_dir, "train.steps=30", "checkpoint.every=10"))
  assert out.returncode == 0, out.stderr[-3000:]
  return job, cli.losses(job)


def test_sigterm_saves_exits_cleanly_and_resume_continues_the_curve(tmp_path, data_dir, reference):
  _, ref = reference
  job = tmp_path / "job"
  args = cli.command(job, data_dir, "train.steps=30", "checkpoint.every=10")
  proc = cli.start(args, log=tmp_path / "log1")
  assert cli.wait_for(lambda: max(cli.losses(job), default=0) >= 4)
  proc.send_signal(cli.SIGTERM)
  assert proc.wait(timeout=120) == 0, open(tmp_path / "log1").read()[-3000:]
  saved = cli.checkpoint_steps(job)
  assert saved and 4 <= saved[-1] < 30, saved   # saved at the step it was at, not a periodic one
  stopped_at = saved[-1]
  out = cli.run(args)
  assert out.returncode == 0, out.stderr[-3000:]
  got = cli.losses(job)
  assert max(got) == 30
  for step in range(stopped_at + 1, 31):
    np.testing.assert_allclose(got[step], ref[step], rtol=1e-5, err_msg=f"step {step}")


def test_sigkill_during_async_save_resumes_from_last_complete_checkpoint(tmp_path, data_dir, reference):
  _, ref = reference
  job = tmp_path / "job"
  args = cli.command(job, data_dir, "train.steps=30", "checkpoint.every=1", "checkpoint.keep=3")
  proc = cli.start(args, log=tmp_path / "log1")
  ckpts = job / "checkpoints"
  # Kill the moment an uncommitted (temporary) checkpoint directory exists after step 5.
  in_flight = lambda: ckpts.is_dir() and any("tmp" in n for n in os.listdir(ckpts)) and \
      max(cli.losses(job), default=0) >= 5
  assert cli.wait_for(in_flight, poll=0.002)
  proc.kill()
  proc.wait(timeout=60)
  complete = cli.checkpoint_steps(job)
  out = cli.run(args)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"resumed from step {complete[-1]}" in out.stderr or complete[-1] == 30
  got = cli.losses(job)
  for step in range(complete[-1] + 1, 31):
    np.testing.assert_allclose(got[step], ref[step], rtol=1e-5)
  assert not [n for n in os.listdir(ckpts) if "tmp" in n]


def test_truncated_checkpoint_is_detected_and_skipped(tmp_path, data_dir, reference):
  ref_job, ref = reference
  job = tmp_path / "job"
  shutil.copytree(ref_job / "checkpoints", job / "checkpoints")
  assert cli.checkpoint_steps(job) == [10, 20, 30]
  damaged = job / "checkpoints" / "30" / "state"
  biggest = max((p for p in damaged.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  with open(biggest, "r+b") as f:
    f.truncate(biggest.stat().st_size // 2)
  out = cli.run(cli.command(job, data_dir, "train.steps=30", "checkpoint.every=10", "train.eval_every=1"))
  assert out.returncode == 0, out.stderr[-3000:]
  assert "step 30" in out.stderr and "cannot be restored" in out.stderr
  assert "resumed from step 20" in out.stderr
  # moved aside, not deleted (then step 30 was trained and saved afresh)
  assert [n.split("-")[0] for n in os.listdir(job / "checkpoints" / "damaged")] == ["30"]
  got = cli.losses(job)
  for step in range(21, 31):
    np.testing.assert_allclose(got[step], ref[step], rtol=1e-5)


class CorruptBatches(inputs.Batches):
  """The real data pipeline, with one corrupt token id (beyond the vocabulary) at step 3."""
  bad_step = 3

  def __next__(self):
    batch = super().__next__()
    self.count = getattr(self, "count", 0) + 1
    if self.split == "train" and self.count == self.bad_step:
      targets = np.array(batch["targets"])
      targets[0, 0] = 10_000
      batch["targets"] = __import__("jax").device_put(targets, batch["targets"].sharding)
    return batch


def tiny_experiment(data_dir, *sets):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [*cli.TINY, f"data.data_dir={str(data_dir)!r}", "train.steps=6",
                                "checkpoint.every=2", *sets])
  return configs.build(cfg)


def test_nonfinite_step_is_skipped_and_counted(tmp_path, data_dir, monkeypatch):
  monkeypatch.setattr(loop.inputs, "Batches", CorruptBatches)
  summary = loop.train(tiny_experiment(data_dir, "train.nonfinite='skip'"), str(tmp_path))
  assert summary["skipped_steps"] == [3]
  assert not np.isfinite(summary["losses"][3])
  assert all(np.isfinite(summary["losses"][s]) for s in (1, 2, 4, 5, 6))
  for leaf in __import__("jax").tree.leaves(summary["state"]["params"]):
    assert np.isfinite(np.asarray(leaf)).all()


def test_nonfinite_step_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, data_dir, monkeypatch):
  monkeypatch.setattr(loop.inputs, "Batches", CorruptBatches)
  exp = tiny_experiment(data_dir, "train.nonfinite='stop'")
  with pytest.raises(loop.NonFiniteError, match="step 3: loss nan"):
    loop.train(exp, str(tmp_path))
  assert cli.checkpoint_steps(tmp_path) == [2]
  monkeypatch.undo()
  _, step = ckpt_lib.restore_params(model_setup.create(exp, make_mesh(exp.mesh)), str(tmp_path))
  assert step == 2


@pytest.mark.parametrize("sets, message", [
    (["mesh.ici=(2, 4)"], "mesh (2, 4) needs 8 devices, 1 are available"),
    (["train.stpes=3"], "unknown field 'stpes' (did you mean train.steps?)"),
    (["model.d_model=32"], "was written for a different state than this experiment builds"),
    (["data.source='tfds:no_such_dataset'"], "no_such_dataset"),
    (["mesh.num_cpu_devices=8", "mesh.ici=(1, 8)", "sharding.preset='tp'", "model.d_ff=100"],
     "which mesh axes ('model',) (total size 8) do not divide"),
])
def test_bad_input_names_the_problem_and_writes_nothing(reference, data_dir, tmp_path, sets, message):
  ref_job, _ = reference
  job = tmp_path / "job"
  shutil.copytree(ref_job, job)
  before = cli.snapshot(job)
  out = cli.run(cli.command(job, data_dir, "train.steps=40", *sets))
  assert out.returncode == 2, out.stderr[-2000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith("shardax: error:")]
  assert len(errors) == 1 and message in errors[0], out.stderr[-2000:]
  assert cli.snapshot(job) == before


def test_unknown_experiment_writes_nothing(tmp_path, data_dir):
  out = cli.run(cli.command(tmp_path / "job", data_dir, exp="lm.tinyy"))
  assert out.returncode == 2 and "did you mean lm.tiny" in out.stderr
  assert not (tmp_path / "job").exists()
