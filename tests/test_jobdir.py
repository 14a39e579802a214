"""The job-dir path type on a local disk: what a run writes stays readable by the usual tools."""

import json

from shardax.trainer import jobdir
from shardax.trainer.metrics import MetricsWriter


def test_metrics_append_across_runs_and_tensorboard_reads_the_events(tmp_path):
  from tensorboard.backend.event_processing import event_accumulator
  for first, last in ((1, 3), (4, 5)):   # a run and its resumption
    writer = MetricsWriter(str(tmp_path), total_steps=5, enabled=True)
    for step in range(first, last + 1):
      writer.write(step, {"loss": 1.0 / step})
    writer.close()
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
  acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  acc.Reload()
  assert {e.step: round(e.value, 6) for e in acc.Scalars("loss")} == {s: round(1.0 / s, 6) for s in range(1, 6)}


def test_local_paths_are_absolute_and_urls_stay_urls(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(jobdir.path("run")) == str(tmp_path / "run")
  assert str(jobdir.path("gs://bucket/run") / "metrics.jsonl") == "gs://bucket/run/metrics.jsonl"
  assert jobdir.is_remote("gs://bucket/run") and not jobdir.is_remote(tmp_path)
  jobdir.write_text(jobdir.path("run") / "a" / "config.txt", "x")
  assert (tmp_path / "run" / "a" / "config.txt").read_text() == "x"
