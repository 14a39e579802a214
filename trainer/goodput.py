"""Goodput: where a job's wall time went, run by run, and how much of it was training.

Each run keeps one timeline: at every instant exactly one cause is current, so the parts
of a run's record add up to its wall time (from the OS's start of the process to the last
write). Causes:

  startup             process start, imports, cluster join and wait, state init
  data                data preparation and the train iterator's creation
  restore_local       reading the local checkpoint tier (trainer/local_tier.py)
  restore_persistent  reading the job dir's checkpoint
  compile             jax tracing, lowering and XLA compiles (or compilation-cache reads),
                      taken out of whichever cause was current when they ran
  steps               productive training steps (with their logging and device syncs)
  recomputed          steps at or below the previous run's last logged step: work an
                      earlier run had done and lost with its unsaved state
  checkpoint          saves that blocked the loop (the device-to-host copy, the final wait)
  eval                evaluation
  other               shutdown and whatever is between these

Process 0 rewrites its run's record in `job_dir/goodput.json` (a list, one record per run)
at every persistent checkpoint save, at most every FLUSH_S seconds between them (local-tier
saves included: on gs:// each rewrite is a whole upload) and at exit, so a run killed
without warning still leaves its record up to its last write; the time from there to the
next run's start is shown as time between runs. `--mode=goodput` prints the job's goodput
across runs: productive step time over the runs' wall time, and the largest losses.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from absl import logging

from shardax.trainer import compile_cache, jobdir

CAUSES = ("startup", "data", "restore_local", "restore_persistent", "compile", "steps", "recomputed",
          "checkpoint", "eval", "other")
FILE = "goodput.json"
FLUSH_S = 10.0   # and at every persistent checkpoint save


def process_start_time() -> float:
  """When this process started (epoch seconds): from /proc, else now."""
  try:
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    uptime = float(open("/proc/uptime").read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
  except (OSError, ValueError, IndexError):
    return time.time()


def read(job_dir, move_damaged: bool = False) -> list[dict]:
  """The job's run records (empty when none, or when the file is damaged). `move_damaged`:
  the writer (Recorder) moves a damaged file aside so its records start over; a reader
  (`--mode=goodput`) leaves it where it is."""
  f = jobdir.path(job_dir) / FILE
  if not f.exists():
    return []
  try:
    return json.loads(f.read_text())
  except ValueError:   # cut by a kill before writes were atomic
    if not move_damaged:
      logging.warning("goodput: %s is not valid JSON (a write cut short?); no records read", f)
      return []
    aside = f.with_name(FILE + ".damaged")
    f.rename(aside)
    logging.warning("goodput: %s is not valid JSON (a write cut short?); moved to %s, "
                    "the run records start over", f, aside)
    return []


def last_logged_step(job_dir, records: list[dict]) -> int:
  """The furthest step any earlier run logged: from its goodput `records` (as `read` gave
  them) and metrics.jsonl."""
  steps = [r.get("last_step", 0) for r in records]
  f = jobdir.path(job_dir) / "metrics.jsonl"
  if f.exists():
    for line in f.read_text().splitlines():
      try:
        steps.append(int(json.loads(line).get("step", 0)))
      except (ValueError, AttributeError):
        pass   # a line cut by a kill
  return max(steps, default=0)


class Recorder:
  """One run's timeline. `switch(cause)` makes `cause` current; `during(cause)` for a block."""

  def __init__(self, job_dir, write: bool = True, started: float | None = None):
    self.job_dir = job_dir
    self.write_file = write
    self.started = process_start_time() if started is None else started
    self.seconds = dict.fromkeys(CAUSES, 0.0)
    # only the writer reads the job's history: other processes never write or use it
    self.previous = read(job_dir, move_damaged=True) if write else []
    self.prev_last_step = last_logged_step(job_dir, self.previous) if write else 0
    self.info: dict[str, Any] = {"start_step": 0, "last_step": 0, "recomputed_steps": 0, "steps": 0}
    self.cause = "startup"
    self._mark = time.time()
    self._compile_mark = compile_cache.compile_seconds()
    self._flushed = 0.0
    self.status: str | None = None   # set by the first flush; at_exit rewrites only after one
    self.seconds["startup"] = self._mark - self.started   # before this object existed

  def switch(self, cause: str) -> str:
    """Closes the current cause's interval (its compile seconds go to 'compile'); returns it."""
    if cause not in CAUSES:
      raise ValueError(f"goodput cause {cause!r}: use one of {CAUSES}")
    now, compiled = time.time(), compile_cache.compile_seconds()
    elapsed = now - self._mark
    moved = min(max(compiled - self._compile_mark, 0.0), elapsed)
    self.seconds[self.cause] += elapsed - moved
    self.seconds["compile"] += moved
    self._mark, self._compile_mark = now, compiled
    previous, self.cause = self.cause, cause
    return previous

  def during(self, cause: str):
    rec = self
    class _Block:
      def __enter__(self):
        self.previous = rec.switch(cause)
      def __exit__(self, *exc):
        rec.switch(self.previous)
    return _Block()

  def step(self, step: int) -> None:
    """Before step `step` runs: is it new work or work an earlier run already did?"""
    redo = step <= self.prev_last_step
    self.info["recomputed_steps" if redo else "steps"] += 1
    self.info["last_step"] = step
    self.switch("recomputed" if redo else "steps")

  def at_exit(self) -> None:
    """Rewrites a finished run's record once more as the interpreter exits (the CLI calls it
    from an atexit handler registered before jax's), so the shutdown after training, lease
    release and orbax/jax teardown, is in its wall time too, as 'other'."""
    if self.status is not None:
      self.switch("other")
      self.flush(self.status, force=True)

  def record(self, status: str) -> dict:
    self.switch(self.cause)
    wall = self._mark - self.started
    return {"run": len(self.previous) + 1, "started": self.started, "wall_s": wall, "status": status,
            "seconds": dict(self.seconds), **self.info}

  def flush(self, status: str = "running", force: bool = False) -> dict | None:
    """Rewrites this run's record (throttled to FLUSH_S unless forced)."""
    if not self.write_file or (not force and time.time() - self._flushed < FLUSH_S):
      return None
    self.status = status
    rec = self.record(status)
    jobdir.write_text(jobdir.path(self.job_dir) / FILE, json.dumps(self.previous + [rec], indent=1))
    self._flushed = time.time()
    return rec


def summarize(records: list[dict]) -> dict:
  """The job's goodput across `records`: productive step seconds over their wall seconds,
  and each cause's share; the gaps between runs are reported, not counted (a job resumed
  a week later is not a week of lost training)."""
  wall = sum(r["wall_s"] for r in records)
  by_cause = {c: sum(r["seconds"].get(c, 0.0) for r in records) for c in CAUSES}
  ends = [(r["started"], r["started"] + r["wall_s"]) for r in records]
  gaps = sum(max(0.0, b[0] - a[1]) for a, b in zip(ends, ends[1:]))
  return {"runs": len(records), "wall_s": wall, "goodput": by_cause["steps"] / wall if wall else 0.0,
          "seconds": by_cause, "between_runs_s": gaps,
          "steps": sum(r.get("steps", 0) for r in records),
          "recomputed_steps": sum(r.get("recomputed_steps", 0) for r in records)}


def format_report(records: list[dict], top: int = 4) -> str:
  """'goodput 71.2% over 3 runs (412 s): lost to compile 40.1 s (9.7%), ...'."""
  if not records:
    return "goodput: no runs recorded"
  s = summarize(records)
  losses = sorted(((v, c) for c, v in s["seconds"].items() if c != "steps" and v > 0), reverse=True)
  lost = ", ".join(f"{c} {v:.1f}s ({v / s['wall_s']:.1%})" for v, c in losses[:top])
  restored = [f"run {r['run']}: {r['restored']['tier']} step {r['restored']['step']}"
              for r in records if r.get("restored")]
  return (f"goodput {s['goodput']:.1%} over {s['runs']} run(s) ({s['wall_s']:.1f}s wall, "
          f"{s['steps']} new steps, {s['recomputed_steps']} recomputed); largest losses: {lost}"
          + (f"; restores: {', '.join(restored)}" if restored else "")
          + (f"; {s['between_runs_s']:.0f}s between runs not counted" if s["between_runs_s"] >= 1 else ""))
