"""Goodput (trainer/goodput.py): a run's record covers its wall time, steps an earlier run
had already done count as recomputed, and the job report ranks the losses."""

import json
import time

import pytest

import clitools as cli
from shardax.trainer import goodput, jobdir, loop
from test_trainer import small_experiment


def test_steps_an_earlier_run_logged_count_as_recomputed(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 7)))
  rec = goodput.Recorder(str(tmp_path), started=time.time() - 2.0)   # 2 s of start-up before it
  with rec.during("restore_persistent"):
    time.sleep(0.05)
  for s in range(5, 10):   # restored at step 4; the killed run had logged up to 7
    rec.step(s)
    time.sleep(0.02)
  with rec.during("eval"):
    time.sleep(0.05)
  r = rec.flush("finished", force=True)
  assert (r["recomputed_steps"], r["steps"]) == (3, 2)
  assert r["seconds"]["recomputed"] > 0.04 and r["seconds"]["steps"] > 0.02
  assert r["seconds"]["restore_persistent"] >= 0.05 and r["seconds"]["eval"] >= 0.05
  assert abs(sum(r["seconds"].values()) - r["wall_s"]) < 1e-6 and r["wall_s"] >= 2.2
  assert goodput.read(tmp_path) == [r]
  report = goodput.format_report([r, dict(r, run=2)])
  assert report.startswith(f"goodput {r['seconds']['steps'] / r['wall_s']:.1%} over 2 run(s)")
  assert "largest losses: startup" in report   # the 2 s of start-up is the biggest loss


@pytest.mark.slow   # two CLI runs and a kill: ~15 s unloaded
def test_a_restarted_run_records_its_wall_time_and_recomputed_steps(tmp_path):
  data_dir, job = tmp_path / "data", tmp_path / "job"
  args = lambda steps: cli.command(job, data_dir, f"train.steps={steps}", "checkpoint.every=100")  # noqa: E731
  killed = cli.start(args(1000), log=tmp_path / "run1.log")
  try:
    assert cli.wait_for(lambda: max(cli.losses(job), default=0) >= 3, timeout=200), open(tmp_path / "run1.log").read()
  finally:
    killed.send_signal(cli.SIGKILL)
    killed.wait()
  logged = max(cli.losses(job))   # no checkpoint was saved: the restart redoes all of them
  t0 = time.time()
  out = cli.run(args(logged + 2))
  t1 = time.time()
  assert out.returncode == 0, out.stderr[-3000:]
  last = goodput.read(job)[-1]
  assert (last["status"], last["recomputed_steps"], last["steps"]) == ("finished", logged, 2)
  assert abs(sum(last["seconds"].values()) - last["wall_s"]) < 1.0, last
  assert abs(last["started"] - t0) < 1.0, (last, t0)   # from the process's start, not main()'s
  # it ends at the CLI's atexit; the interpreter's own teardown after it is not in the record
  assert 0 <= t1 - (last["started"] + last["wall_s"]) < 3.0, (last, t1)
  assert "goodput " in out.stderr and f"{logged} recomputed" in out.stderr
  assert "compilation cache hits" in out.stderr and "\n0 compilation cache hits" not in out.stderr


def test_a_goodput_file_cut_by_a_kill_does_not_stop_the_next_run(tmp_path):
  """A run SIGKILLed while writing goodput.json (before writes went through a rename) left it
  cut; the restart failed with `shardax: error: Expecting value` (CI, 2026-11-26). Now the file
  is moved aside by the run's writer (not by a reader: `--mode=goodput`, other processes),
  named in a warning, and the records start over; and writes are atomic."""
  (tmp_path / "goodput.json").write_text('[{"run": 1, "wall')
  assert goodput.read(tmp_path) == []
  goodput.Recorder(str(tmp_path), write=False)   # a process other than 0
  assert (tmp_path / "goodput.json").read_text() == '[{"run": 1, "wall'
  goodput.Recorder(str(tmp_path))   # what a restarted run does first
  assert (tmp_path / "goodput.json.damaged").read_text() == '[{"run": 1, "wall'
  jobdir.write_text(tmp_path / "goodput.json", json.dumps([{"run": 2}]))
  assert goodput.read(tmp_path) == [{"run": 2}]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.json", "goodput.json.damaged"]


def test_local_saves_do_not_force_a_rewrite_and_the_throttle_runs_every_step(tmp_path, monkeypatch):
  """goodput.json (a whole upload on gs://) was rewritten after every local-tier save, and the
  throttled rewrite ran only on log steps. Now: the first step's throttled write (nothing was
  written yet), then none until the persistent save at the last step, and the exit's."""
  writes, write_text = [], jobdir.write_text
  def spy(f, text):
    if str(f).endswith(goodput.FILE):
      writes.append(json.loads(text)[-1]["last_step"])
    write_text(f, text)
  monkeypatch.setattr(jobdir, "write_text", spy)
  monkeypatch.setattr(goodput, "FLUSH_S", 1e9)
  exp = small_experiment(str(tmp_path / "data"), "train.steps=5", "train.log_every=100",
                         "train.eval_every=100", "checkpoint.every=100",
                         f"checkpoint.local_dir={str(tmp_path / 'local')!r}", "checkpoint.local_every=2")
  loop.train(exp, str(tmp_path / "job"))
  assert writes == [1, 5, 5]
