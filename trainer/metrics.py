"""Where scalars go: TensorBoard event files, `metrics.jsonl`, and progress lines.

Only process 0 writes, so a pod of hosts produces one record. Both files go through
the job-dir path type (trainer/jobdir.py), so a gs:// job dir holds them too; the
TensorBoard records are written with tensorboard's own protos and record framing
(no TensorFlow file system needed, which cannot reach every store).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
from typing import Mapping

import jax
from absl import logging

from shardax.trainer import jobdir


def _fmt_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


_serial = itertools.count()


class TensorBoardWriter:
  """Scalars as a TensorBoard event file (`events.out.tfevents.*`) under `directory`."""

  def __init__(self, directory):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter
    self._event, self._summary = event_pb2.Event, summary_pb2.Summary
    # One new file per writer, as TensorFlow's writer does: a resumed run adds a file.
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{next(_serial)}.v2"
    self._file = jobdir.AppendFile(jobdir.path(directory) / name, binary=True, truncate=True)
    self._records = RecordWriter(self._file)
    self._records.write(self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    values = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
    self._records.write(event.SerializeToString())
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class MetricsWriter:
  """Writes every logged scalar to TensorBoard and one JSON line per step."""

  def __init__(self, job_dir: str, total_steps: int, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.total_steps = total_steps
    self._tb = None
    self._jsonl = None
    self._last = None  # (time, step) of the previous progress line
    if self.enabled:
      root = jobdir.path(job_dir)
      self._tb = TensorBoardWriter(root / "tensorboard")
      self._jsonl = jobdir.AppendFile(root / "metrics.jsonl")

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    self._tb.write_scalars(step, scalars)
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    self._jsonl.flush()

  def progress(self, step: int, loss: float, tokens_per_step: int, note: str = "") -> dict[str, float]:
    """Print a progress line (`note`, e.g. what MoE routing dropped, after the loss); returns
    the rates it measured since the previous one."""
    now = time.perf_counter()
    rates = {}
    if self._last is not None and step > self._last[1]:
      dt = now - self._last[0]
      steps_per_s = (step - self._last[1]) / dt
      rates = {"steps_per_s": steps_per_s, "tokens_per_s": steps_per_s * tokens_per_step}
    self._last = (now, step)
    if self.enabled:
      line = f"step {step:>6}/{self.total_steps} | loss {loss:.4f}{note}"
      if rates:
        eta = (self.total_steps - step) / rates["steps_per_s"]
        line += (f" | {rates['steps_per_s']:.2f} steps/s | {rates['tokens_per_s']:,.0f} tokens/s"
                 f" | ETA {_fmt_duration(eta)}")
      logging.info(line)
      print(line, flush=True)
    return rates

  def reset_clock(self) -> None:
    """Forget the last progress time (after eval or a checkpoint, which are not step time)."""
    if self._last is not None:
      self._last = (time.perf_counter(), self._last[1])

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()
