"""What a run prints, and the full log it keeps in the job dir.

The terminal gets the progress lines (printed), warnings and errors; libraries' INFO
records (orbax's checkpoint chatter, absl, jax) are kept off it. `--verbosity=N` / `-v N`
(absl's own flag) brings them back: the terminal then shows what that level allows.

Every record at INFO and above (DEBUG with `-v 1`) still goes to `job_dir/log.txt`, in
absl's format, whatever the terminal shows. The file is opened only once the job dir is
known to be good (`to_job_dir`, called where the run writes its config), so a mistyped
flag never leaves a file behind; records from before that moment are held in memory and
written first. log.txt belongs to the modes that hold the job dir's lease (train, import,
benchmark); dry_run and plan, which may run beside a live job, log to `dry_run.log.txt` /
`plan.log.txt` (main.py `write_config`), and the other modes keep no log file.

Object stores: the path goes through `etils.epath`, so `gs://...` job dirs work. A local
file is appended to and flushed per record (nothing lost on a crash). An object store
has no append: there the whole log is rewritten at most every `UPLOAD_EVERY_S` seconds
and once more when the process exits, so the last seconds of a killed run may be missing.

C++ side: TensorFlow (imported by clu's TensorBoard writer) prints a oneDNN notice when
its oneDNN ops are on; shardax runs no TensorFlow compute, so they are switched off
(TF_ENABLE_ONEDNN_OPTS=0) along with TF's C++ INFO logging, unless the user set them.
"""

from __future__ import annotations

import atexit
import logging
import os

LOG_NAME = "log.txt"
UPLOAD_EVERY_S = 30.0


def quiet_native_logs() -> None:
  """Before TensorFlow or XLA load: no C++ INFO notices on the terminal."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


class JobLog(logging.Handler):
  """Holds records in memory until `open(job_dir, name)`, then writes them to job_dir/name
  (a `jobdir.AppendFile`: appended locally, rewritten now and then on an object store)."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self._pending: list[str] = []
    self._file = None

  def open(self, job_dir: str, name: str = LOG_NAME) -> None:
    from shardax.trainer import jobdir
    if self._file is not None:
      return
    self._file = jobdir.AppendFile(jobdir.path(job_dir) / name, flush_every_s=UPLOAD_EVERY_S)
    self._file.write("".join(self._pending))
    self._file.flush()
    self._pending = []

  def emit(self, record: logging.LogRecord) -> None:
    try:
      line = self.format(record) + "\n"
    except Exception:  # a bad format string must not kill the run
      self.handleError(record)
      return
    if self._file is None:
      self._pending.append(line)
      return
    self._file.write(line)
    self._file.flush()   # locally per record; on a store at most every UPLOAD_EVERY_S

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    super().close()


_job_log: JobLog | None = None


def setup(verbosity: int | None) -> JobLog:
  """Terminal at WARNING (or at `verbosity`, absl's scale, when the user gave one); the job
  log at INFO (DEBUG when the verbosity asks for it). Call once absl has parsed the flags."""
  global _job_log
  from absl import logging as absl_logging
  absl_logging.use_absl_handler()
  levels = {-3: logging.FATAL, -2: logging.ERROR, -1: logging.WARNING, 0: logging.INFO}
  terminal = logging.WARNING if verbosity is None else levels.get(verbosity, logging.DEBUG)
  logging.root.setLevel(min(terminal, logging.INFO))
  absl_logging.get_absl_handler().setLevel(terminal)
  if _job_log is None:
    _job_log = JobLog()
    _job_log.setFormatter(absl_logging.PythonFormatter())
    logging.root.addHandler(_job_log)
    atexit.register(_job_log.close)
  return _job_log


def to_job_dir(job_dir: str, name: str = LOG_NAME) -> None:
  """From now on (and everything logged before), the full log goes to job_dir/`name`:
  log.txt for the mode that holds the job dir's lease, a file of its own for another."""
  if _job_log is not None:
    _job_log.open(job_dir, name)
