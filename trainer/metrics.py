"""Where scalars go: TensorBoard (clu metric writers), `metrics.jsonl`, and progress lines.

Only process 0 writes, so a pod of hosts produces one record. clu's writers
import TensorFlow, so they are imported here, lazily, and never from model code.
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

import jax
from absl import logging


def _fmt_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsWriter:
  """Writes every logged scalar to TensorBoard and one JSON line per step."""

  def __init__(self, job_dir: str, total_steps: int, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.total_steps = total_steps
    self._tb = None
    self._jsonl = None
    self._last = None  # (time, step) of the previous progress line
    if self.enabled:
      os.makedirs(job_dir, exist_ok=True)
      from clu import metric_writers
      self._tb = metric_writers.SummaryWriter(os.path.join(job_dir, "tensorboard"))
      self._jsonl = open(os.path.join(job_dir, "metrics.jsonl"), "a", buffering=1)

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    self._tb.write_scalars(step, scalars)
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")

  def progress(self, step: int, loss: float, tokens_per_step: int) -> dict[str, float]:
    """Print a progress line; returns the rates it measured since the previous one."""
    now = time.perf_counter()
    rates = {}
    if self._last is not None and step > self._last[1]:
      dt = now - self._last[0]
      steps_per_s = (step - self._last[1]) / dt
      rates = {"steps_per_s": steps_per_s, "tokens_per_s": steps_per_s * tokens_per_step}
    self._last = (now, step)
    if self.enabled:
      line = f"step {step:>6}/{self.total_steps} | loss {loss:.4f}"
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
      self._tb.flush()
      self._tb.close()
    if self._jsonl is not None:
      self._jsonl.close()
