"""Modes without the job dir's lease (dry_run, plan, explain, eval, decode, export) may run
beside a live training job, so they never write that job's config.txt, config.json or
log.txt: they write reports named after themselves (dry_run.json, dry_run.config.json,
dry_run.log.txt, ...). Real `python -m shardax.main` processes on a real job dir."""

import json

from clitools import command, run

JOB_FILES = ("config.json", "config.txt", "log.txt")


def test_report_modes_leave_a_trained_jobs_files_byte_identical(tmp_path):
  """A one-step train run writes the job's three files; a dry run and an explain of the same
  experiment with another config (train.steps=7) leave them byte for byte as they were and
  write their own. Fails when a report mode writes the job's config or opens its log."""
  job, data = tmp_path / "job", tmp_path / "data"
  trained = run(command(job, data, "train.steps=1", "checkpoint.enabled=False"))
  assert trained.returncode == 0, trained.stderr[-3000:]
  before = {f: (job / f).read_bytes() for f in JOB_FILES}
  assert all(before.values()), before.keys()
  for mode in ("dry_run", "explain"):
    proc = run(command(job, data, "train.steps=7", "data.source='synthetic'", mode=mode))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {f: (job / f).read_bytes() for f in JOB_FILES} == before, mode
  assert json.loads((job / "dry_run.config.json").read_text())["train"]["steps"] == 7
  assert "train.steps = 7" in (job / "dry_run.config.txt").read_text()
  assert (job / "dry_run.log.txt").stat().st_size > 0 and (job / "dry_run.json").exists()
  assert json.loads((job / "config.json").read_text())["train"]["steps"] == 1
