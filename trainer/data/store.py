"""Where prepared data lives: a local directory or an object store (gs://, s3://).

ArrayRecord reads and writes local files only, so a prepared set on a bucket is written
locally and uploaded whole (an object appears complete or not at all), and a reader
copies the shard files it owns, and only those, into a local cache before opening them.
Paths are plain strings; remote ones go through etils.epath, the path type the job dir
uses (trainer/jobdir.py), so the same emulator and credentials serve both.

`create_if_absent` is the commit every concurrent preparer agrees on: the first writer of
an object wins and the others read what it wrote. Locally it is a hard link of a
complete temporary file (atomic, fails if the name exists); on GCS an upload with the
precondition ifGenerationMatch=0 ("only if no live object has this name"), which GCS
evaluates atomically server-side. Other stores (s3://) have no such precondition in
fsspec: there it is check-then-write, and racing preparers must agree by content (theirs
is identical: preparation is deterministic), which is why only small, deterministic files
are committed this way.
"""

from __future__ import annotations

import hashlib
import os
import uuid

REMOTE = ("gs://", "s3://")
CACHE_ROOT = os.path.expanduser(os.environ.get("SHARDAX_DATA_CACHE", "~/.cache/shardax/prepared-cache"))


def is_remote(path: str) -> bool:
  return str(path).startswith(REMOTE)


def _epath(path: str):
  from etils import epath
  return epath.Path(path)


def join(directory: str, *names: str) -> str:
  return "/".join([directory.rstrip("/"), *names]) if is_remote(directory) else os.path.join(directory, *names)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def read_bytes(path: str) -> bytes:
  if is_remote(path):
    return _epath(path).read_bytes()
  with open(path, "rb") as f:
    return f.read()


def temp_beside(dst: str) -> str:
  """A private local file name to write `dst` into first: beside it locally (so the final
  rename is atomic), in the temporary directory for a remote `dst`."""
  tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
  if not is_remote(dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    return dst + tag
  import tempfile
  return os.path.join(tempfile.gettempdir(), os.path.basename(dst) + tag)


def publish(local_file: str, dst: str) -> None:
  """Moves a complete local file to `dst` in one step: a rename, or one upload. Racing
  writers of the same deterministic file leave one complete copy either way."""
  if is_remote(dst):
    _epath(local_file).copy(_epath(dst), overwrite=True)
    os.remove(local_file)
  else:
    os.replace(local_file, dst)


def create_if_absent(dst: str, data: bytes) -> bool:
  """Writes `data` to `dst` unless it exists; True if this call created it (see above)."""
  if not is_remote(dst):
    tmp = temp_beside(dst)
    with open(tmp, "wb") as f:
      f.write(data)
    try:
      os.link(tmp, dst)
      return True
    except FileExistsError:
      return False
    finally:
      os.remove(tmp)
  if dst.startswith("gs://"):
    fs = _gcs()
    try:
      fs.pipe(dst, data, mode="create")
      return True
    except FileExistsError:
      return False
    except OSError as e:   # gcsfs reports the failed precondition as an HTTP 412
      if "412" in str(e) or "recondition" in str(e):
        return False
      raise
  if _epath(dst).exists():
    return False
  _epath(dst).write_bytes(data)
  return True


def _gcs():
  """The fsspec GCS filesystem (it honours STORAGE_EMULATOR_HOST, like epath's)."""
  import fsspec
  return fsspec.filesystem("gs")


def local_copy(path: str) -> str:
  """A local path with `path`'s content: itself if local, else a copy in the cache
  (downloaded once, atomically, so concurrent readers never see half a file)."""
  if not is_remote(path):
    return path
  digest = hashlib.sha256(path.encode()).hexdigest()[:16]
  local = os.path.join(CACHE_ROOT, digest, os.path.basename(path))
  if not os.path.exists(local):
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = temp_beside(local)
    _epath(path).copy(_epath(tmp), overwrite=True)
    os.replace(tmp, local)
  return local
