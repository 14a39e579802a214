"""The job dir as one path type: a local directory or an object-store URL (gs://, s3://).

Every file a run reads or writes under `--job_dir` goes through here, through
`etils.epath` (the path type orbax itself uses), so `--job_dir=gs://bucket/run` puts
the config, metrics, TensorBoard events, checkpoints and reports in the bucket, one
copy for the whole job, instead of a local directory named `gs:` on every host.
Local paths behave as before.

Object stores have no append and no partial writes: a file that grows (metrics.jsonl,
the TensorBoard event file, the MLPerf log) is kept in memory and the whole object is
rewritten every `flush_every_s` seconds and on close. A killed run so loses at most
that interval of log lines, never a checkpoint (orbax commits those itself).
Profiler traces are written by the profiler to a local directory and copied up.

Which client talks to the store is epath's choice: TensorFlow's file system when
TensorFlow is installed, else fsspec (gcsfs, s3fs); EPATH_USE_TF=false picks fsspec,
which also honours storage emulators (STORAGE_EMULATOR_HOST). Orbax writes array data
with tensorstore's own GCS driver (TENSORSTORE_GCS_HTTP_URL points it at an emulator).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from etils import epath

REMOTE_SCHEMES = ("gs://", "s3://")


def is_remote(job_dir) -> bool:
  return os.fspath(job_dir).startswith(REMOTE_SCHEMES)


def path(job_dir) -> epath.Path:
  """The job dir (or a file in it) as an epath.Path; local paths are made absolute."""
  if isinstance(job_dir, epath.Path) and is_remote(job_dir):
    return job_dir
  text = os.fspath(job_dir)
  return epath.Path(text if is_remote(text) else os.path.abspath(os.path.expanduser(text)))


def write_text(file, text: str) -> None:
  """Write a whole (small) file: a report, the resolved config."""
  file = path(file)
  file.parent.mkdir(parents=True, exist_ok=True)
  file.write_text(text)


def read_text(file) -> str:
  return path(file).read_text()


class AppendFile:
  """A growing text or binary file: real appends locally, whole-object rewrites on a store.

  `write` and `flush` are what `logging.StreamHandler` and record writers need; on an
  object store `flush` uploads at most every `flush_every_s` seconds, `close` always.
  `truncate=True` starts empty, else existing content is kept (a resumed run appends).
  """

  def __init__(self, file, binary: bool = False, truncate: bool = False, flush_every_s: float = 30.0):
    self.path = path(file)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._binary = binary
    self._remote = is_remote(self.path)
    self._flush_every_s = flush_every_s
    self._last_upload = time.monotonic()
    self._dirty = False
    if self._remote:
      empty = b"" if binary else ""
      exists = not truncate and self.path.exists()
      self._content = [(self.path.read_bytes() if binary else self.path.read_text()) if exists else empty]
      self._local = None
    else:
      mode = ("w" if truncate else "a") + ("b" if binary else "")
      self._local = open(os.fspath(self.path), mode, **({} if binary else {"buffering": 1}))

  def write(self, data) -> int:
    if self._local is not None:
      return self._local.write(data)
    self._content.append(data)
    self._dirty = True
    return len(data)

  def flush(self, force: bool = False) -> None:
    if self._local is not None:
      self._local.flush()
      return
    if self._dirty and (force or time.monotonic() - self._last_upload >= self._flush_every_s):
      joined = (b"" if self._binary else "").join(self._content)
      self._content = [joined]
      if self._binary:
        self.path.write_bytes(joined)
      else:
        self.path.write_text(joined)
      self._dirty = False
      self._last_upload = time.monotonic()

  def close(self) -> None:
    if self._local is not None:
      self._local.close()
      self._local = None
    elif self._dirty:
      self.flush(force=True)


_tracing: list[tuple[str, epath.Path]] = []   # (local staging dir, job-dir target) of the live trace


def start_trace(directory) -> None:
  """jax.profiler.start_trace into `directory`; on an object store via a local staging dir."""
  import jax
  target = path(directory)
  local = tempfile.mkdtemp(prefix="shardax-profile-") if is_remote(target) else os.fspath(target)
  _tracing.append((local, target))
  jax.profiler.start_trace(local, create_perfetto_trace=True)  # perfetto_trace.json.gz: readable without TensorBoard


def stop_trace() -> None:
  """jax.profiler.stop_trace, then copy a staged trace into the job dir."""
  import jax
  jax.profiler.stop_trace()
  local, target = _tracing.pop()
  if os.fspath(target) == local:
    return
  for root, _, files in os.walk(local):
    for name in files:
      src = os.path.join(root, name)
      dst = target / os.path.relpath(src, local)
      dst.parent.mkdir(parents=True, exist_ok=True)
      with open(src, "rb") as f:
        dst.write_bytes(f.read())
  shutil.rmtree(local, ignore_errors=True)
