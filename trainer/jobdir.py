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

import json
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
  """Write a whole (small) file: a report, the resolved config. Locally through a temporary
  file renamed over it, so a process killed mid-write leaves the old file or the new one,
  never a cut one that the next run cannot parse (an object store's upload is whole anyway)."""
  file = path(file)
  file.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(file):
    file.write_text(text)
    return
  os.replace(_complete_copy(file, text), os.fspath(file))


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



# --- the job dir's identity: which job a file outside the job dir belongs to -----------------

IDENTITY_FILE = "identity.json"


def identity(job_dir, primary: bool = True, sync=lambda: None, timeout_s: float = 60.0) -> str:
  """The job dir's identity: a random id made once, when the job first writes into the job
  dir, and kept in `identity.json` there for as long as the job dir exists.

  Files a job keeps outside its job dir (the local checkpoint tier) record it, so that a
  job dir deleted and made again at the same path (a new identity) never takes them for
  its own. The primary process creates the file atomically (`create_exclusive`: of two
  creators one wins, and both read the winner's id) or rewrites a damaged one; `sync` is a
  barrier across the job's processes (run by every process), after which the others read
  it, waiting up to `timeout_s` for an object store to show it.
  """
  file = path(job_dir) / IDENTITY_FILE
  if primary:
    import uuid
    text = json.dumps({"id": uuid.uuid4().hex, "created": time.time()})
    if not is_remote(file):
      file.parent.mkdir(parents=True, exist_ok=True)
    if not create_exclusive(file, text) and _read_identity(file) is None:
      from absl import logging
      logging.warning("job dir identity %s is damaged; writing a new one (files kept outside the "
                      "job dir under the old one, such as local checkpoint steps, are dropped)", file)
      write_text(file, text)
  sync()
  deadline = time.monotonic() + timeout_s
  while (found := _read_identity(file)) is None:
    if time.monotonic() > deadline:
      raise FileNotFoundError(f"job dir identity {file} was not readable within {timeout_s:.0f}s of "
                              f"process 0 writing it: every process must see the same --job_dir")
    time.sleep(0.2)
  return found


def _read_identity(file) -> str | None:
  try:
    return str(json.loads(file.read_text())["id"])
  except (FileNotFoundError, ValueError, KeyError, TypeError):
    return None


# --- the job dir's lease: one live job per job dir ----------------------------------------

LEASE_FILE = "lease.json"
HEARTBEAT_S = 10.0   # process 0 rewrites the lease this often
STALE_S = 60.0       # a lease whose heartbeat is older than this is a dead job's


class LeaseError(RuntimeError):
  """The job dir is in use by another live job."""


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def live_holder(lease: dict | None, now: float | None = None) -> str | None:
  """Who holds `lease` if it belongs to a live job, else None.

  Live: a heartbeat younger than its stale_s, and, on this very host, a process that
  still exists (a job killed on this host frees its job dir at once).
  """
  if not lease:
    return None
  import socket
  now = time.time() if now is None else now
  age = now - float(lease.get("heartbeat", 0))
  if age > float(lease.get("stale_s", STALE_S)):
    return None
  if lease.get("host") == socket.gethostname() and not _alive(int(lease.get("pid", 0))):
    return None
  started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(lease.get("start", 0))))
  return (f"host {lease.get('host')} (pid {lease.get('pid')}), started {started}, "
          f"last heartbeat {age:.0f}s ago")


def _gcs(file):
  """(gcsfs file system, bucket/key) for a gs:// file when gcsfs is installed, else None."""
  if not os.fspath(file).startswith("gs://"):
    return None
  try:
    import fsspec
    return fsspec.core.url_to_fs(os.fspath(file))
  except ImportError:
    return None


def create_exclusive(file, text: str) -> bool:
  """Write `file` with `text` only if it does not exist, atomically: True if this call made it.

  Local: a complete temporary file hard-linked into place (the link fails if the name
  exists, and no reader ever sees a half-written file). gs://: an upload with
  ifGenerationMatch=0 (gcsfs). Elsewhere (s3://, gs:// without gcsfs) only best effort:
  look, then write.
  """
  gcs = _gcs(file)
  if gcs is not None:
    fs, key = gcs
    try:
      fs.pipe_file(key, text.encode(), mode="create")
    except FileExistsError:
      return False
    finally:
      fs.invalidate_cache(key)
    return True
  if is_remote(file):
    if path(file).exists():
      return False
    write_text(file, text)
    return True
  tmp = _complete_copy(file, text)
  try:
    os.link(tmp, os.fspath(file))
    return True
  except FileExistsError:
    return False
  finally:
    os.unlink(tmp)


def _complete_copy(file, text: str) -> str:
  """A temporary local file beside `file` holding all of `text`, to link or move into place."""
  tmp = f"{os.fspath(file)}.{os.getpid()}.{time.monotonic_ns()}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  return tmp


class Lease:
  """A lease file in the job dir, taken atomically by process 0 and heartbeat by a thread.

  `acquire` comes first, before the job prepares data, imports or restores anything: process
  0 creates the lease only if none exists (`create_exclusive`), so of two jobs started
  together exactly one wins; a lease whose holder is dead (heartbeat older than `stale_s`,
  or its process gone from this host) is rewritten by the one job that creates its
  takeover marker (`_claim`).
  The other processes of the job learn the outcome from process 0 (`any_process`: an
  all-gather in a multi-process job) and refuse with it. Released (the file removed) on
  exit. A holder that finds its lease replaced (it was silent too long) logs an error and
  stops rewriting it. Without gcsfs (gs:// through TensorFlow) or on s3:// the create is
  read-then-write: two jobs racing there can both win.
  """

  def __init__(self, job_dir, primary: bool = True, any_process=lambda flag: flag,
               heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S):
    import socket
    import threading
    import uuid
    self.file = path(job_dir) / LEASE_FILE
    self.primary, self.any_process = primary, any_process
    self.heartbeat_s, self.stale_s = heartbeat_s, stale_s
    self.record = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                   "start": time.time(), "heartbeat": time.time(), "stale_s": stale_s}
    self._stop = threading.Event()
    self._thread = None
    self._made_dir = False
    self._marker = None   # the takeover marker this lease made, if it replaced a dead job's

  def read(self) -> dict | None:
    try:
      return json.loads(self.file.read_text())
    except (FileNotFoundError, ValueError):
      return None

  def _text(self) -> str:
    self.record["heartbeat"] = time.time()
    return json.dumps(self.record)

  def _refusal(self, holder: str | None) -> LeaseError:
    return LeaseError(f"job dir {self.file.parent} is in use by another live job: "
                      f"{holder or 'seen by another process of this job'}. Stop that job or use "
                      f"another --job_dir (a lease silent for {self.stale_s:.0f}s is taken over)")

  def _claim(self, timeout_s: float = 30.0) -> str | None:
    """Process 0: create the lease, or name the live job holding it (None: taken).

    A dead job's lease is taken over through a marker named after its exact content,
    created exclusively: of several jobs judging the same lease dead, one makes the marker
    and rewrites the lease; the others look again and find the new holder alive.
    """
    import hashlib
    parent, made = self.file.parent, False
    if not is_remote(parent):   # (an object store has no directories)
      try:
        parent.mkdir(parents=True)
        made = True   # this job made the job dir: release removes it if the job left it empty
      except FileExistsError:
        pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      if create_exclusive(self.file, self._text()):
        self._made_dir = made
        return None
      try:
        text = self.file.read_text()
      except FileNotFoundError:   # released meanwhile: try to create it again
        continue
      try:
        holder = live_holder(json.loads(text))
      except ValueError:   # not a lease (damaged): as good as dead
        holder = None
      if holder is not None:
        return holder
      marker = self.file.parent / f"{LEASE_FILE}.takeover-{hashlib.sha1(text.encode()).hexdigest()[:16]}"
      if create_exclusive(marker, self._text()):
        write_text(self.file, self._text())
        self._marker = marker
        return None
      self._clear_if_stale(marker)
      time.sleep(0.05)   # another job is taking it over: its lease appears in a moment
    return "a job that keeps taking over the dead job's lease (a takeover marker stays live)"

  def _clear_if_stale(self, marker) -> None:
    """A takeover marker whose job died before rewriting the lease blocks no one forever."""
    try:
      if live_holder(json.loads(marker.read_text())) is None:
        marker.unlink(missing_ok=True)
    except (FileNotFoundError, ValueError):
      pass

  def acquire(self) -> "Lease":
    """Every process: take the lease (process 0, atomically) or refuse (LeaseError) naming
    the holder; then start the heartbeat. Call before the job writes anything."""
    if self._thread is not None:
      return self
    holder = self._claim() if self.primary else None
    if self.any_process(holder is not None):
      if holder is None and not self.primary:
        holder = live_holder(self.read())
      raise self._refusal(holder)
    if self.primary:
      import threading
      self._thread = threading.Thread(target=self._beat, name="shardax-lease", daemon=True)
      self._thread.start()
    return self

  def _beat(self) -> None:
    from absl import logging
    while not self._stop.wait(self.heartbeat_s):
      try:
        current = self.read()
        if not current or current.get("id") != self.record["id"]:
          logging.error("job dir lease %s was taken by another job (%s) after this one was "
                        "silent for over %.0fs; two jobs are writing this job dir", self.file,
                        live_holder(current) or (current or {}).get("host"), self.stale_s)
          return   # never overwrite the new holder's lease
        write_text(self.file, self._text())
      except OSError as e:   # a storage hiccup: the next beat tries again
        logging.warning("lease heartbeat to %s failed: %s", self.file, e)

  def release(self) -> None:
    """Stop the heartbeat and remove the lease if it is still ours; a job dir this lease
    created and nothing else filled (the job failed before writing) is removed too."""
    self._stop.set()
    if self._thread is None:
      return
    self._thread.join(timeout=5)
    self._thread = None
    current = self.read()
    if current and current.get("id") == self.record["id"]:
      self.file.unlink(missing_ok=True)
    if self._marker is not None:
      self._marker.unlink(missing_ok=True)
    if self._made_dir:
      try:
        os.rmdir(os.fspath(self.file.parent))
      except OSError:   # not empty: the job wrote something
        pass

  def __enter__(self) -> "Lease":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()
