"""Where documents come from: `data.source` -> an iterator of texts per split.

    stdlib      the Python standard library's *.py files (always present, ~30 MB of real
                text a small LM can learn); split by a stable hash of each path.
    tfds:NAME   any tfds dataset already prepared as ArrayRecord under data_dir, field
                `data.text_key` ('validation' falls back to 'test'); read without
                TensorFlow through `builder.as_data_source()`.
    files:GLOB  local or object-store files (`files:gs://bucket/web/*.jsonl`; `**`
                recurses): *.jsonl / *.json lines (field data.text_key), *.parquet
                (column data.text_key), anything else as one text document per file.
                Documents are split by a stable hash of "path:index" ("path@offset" for
                JSON lines: the line's byte offset).

A source is cut into `units` (a file, a byte range of a JSON-lines file, rows of a
Parquet file, records of a tfds split) that workers read independently, so preparation.py
can tokenize it on every core of every host, each reading only its share; training never
reads a source directly. `fingerprint` names what a source holds (file names, sizes,
times; the tfds version), so a changed source is prepared again instead of silently
reusing stale data.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator

REMOTE = ("gs://", "s3://")
MIN_CHUNK_BYTES = 256           # a JSON-lines file is cut into <= num_shards ranges of >= this
MAX_CHUNK_BYTES = 64 << 20      # ... and of at most this, so a big file spreads over workers
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
SPLITS = ("train", "validation")
TEXT_SOURCES = ("stdlib", "tfds:", "files:")


class MissingDatasetError(FileNotFoundError):
  """A source with no data where the config points (the message says how to fix it)."""


def is_text_source(source: str) -> bool:
  return source == "stdlib" or source.startswith(("tfds:", "files:"))


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[str]:
  """Sorted relative paths of the stdlib's *.py files; site-packages is not the stdlib."""
  rels = []
  for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    rel_dir = os.path.relpath(dirpath, root)
    for f in filenames:
      if f.endswith(".py"):
        rels.append(os.path.normpath(os.path.join(rel_dir, f)).replace(os.sep, "/"))
  return sorted(rels)


def split_of(rel_path: str, validation_fraction: float) -> str:
  """'validation' or 'train', from a stable hash of the path (same on every machine/run)."""
  h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") / 2.0**64
  return "validation" if h < validation_fraction else "train"


def read_source(path: str) -> str:
  """A source file as text, honouring its PEP 263 coding cookie; undecodable bytes replaced."""
  with _open(path) as f:
    data = f.read()
  try:
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)
  except (SyntaxError, LookupError, UnicodeDecodeError):
    return data.decode("utf-8", errors="replace")


def is_remote(path: str) -> bool:
  return path.startswith(REMOTE)


def _open(path: str):
  """A binary file: local, or an object through etils.epath (the job dir's path type)."""
  if is_remote(path):
    from etils import epath
    return epath.Path(path).open("rb")
  return open(path, "rb")


def _size_and_time(path: str) -> tuple[int, float]:
  if is_remote(path):
    from etils import epath
    st = epath.Path(path).stat()
    return int(st.length), float(st.mtime or 0)
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


def _files_digest(paths: list[str], root: str = "") -> str:
  """Names, sizes and modification times: a changed, added or removed file changes it."""
  h = hashlib.sha256()
  for rel in paths:
    size, mtime = _size_and_time(os.path.join(root, rel) if root else rel)
    h.update(f"{rel}\0{size}\0{mtime}\n".encode())
  return h.hexdigest()[:16]


# --- any prepared tfds dataset ------------------------------------------------------------

def _how_to_prepare(name: str, data_dir: str) -> str:
  return (f"prepare it once with `tfds build {name} --data_dir={data_dir} "
          f"--file_format=array_record` (or `tfds.builder({name!r}, data_dir={data_dir!r})"
          f".download_and_prepare(file_format='array_record')`), then rerun")


def tfds_builder(name: str, data_dir: str):
  """The builder of a tfds dataset prepared (as ArrayRecord) under data_dir, or a clear error."""
  import tensorflow_datasets as tfds  # imported only for tfds sources: it is slow to import
  data_dir = os.path.expanduser(data_dir)
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except Exception as e:  # DatasetNotFoundError, or a registered builder failing to import
    raise MissingDatasetError(
        f"tfds dataset {name!r} was not found under data_dir={data_dir!r} ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); {_how_to_prepare(name, data_dir)}") from e
  if not builder.is_prepared():
    raise MissingDatasetError(f"tfds dataset {name!r} is not prepared under data_dir="
                              f"{data_dir!r}; {_how_to_prepare(name, data_dir)}")
  fmt = str(getattr(builder.info.file_format, "value", builder.info.file_format))
  if fmt != "array_record":
    raise MissingDatasetError(
        f"tfds dataset {name!r} under {data_dir!r} is stored as {fmt!r}, which needs TensorFlow "
        f"to read; re-prepare it with file_format='array_record' (`tfds convert_format`)")
  return builder


def resolve_split(builder, split: str) -> str:
  """'validation' falls back to 'test' for datasets that only have train/test."""
  splits = list(builder.info.splits.keys())
  if split in splits:
    return split
  if split == "validation" and "test" in splits:
    return "test"
  raise ValueError(f"tfds dataset {builder.info.full_name!r} has no split {split!r}; "
                   f"it has {sorted(splits)}")




# --- local files ------------------------------------------------------------------------

def matching_files(pattern: str) -> list[str]:
  """Sorted files matching `pattern` (recursive `**`; gs:// and s3:// globs through
  etils.epath), or a clear error."""
  if is_remote(pattern):
    from etils import epath
    root = _glob_root(pattern)
    rest = pattern[len(root):].lstrip("/")
    files = sorted(str(p) for p in epath.Path(root).glob(rest) if not p.is_dir()) if rest else \
        ([pattern] if epath.Path(pattern).exists() else [])
  else:
    files = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True)
                   if os.path.isfile(f))
  if not files:
    where = "check the bucket and path" if is_remote(pattern) else \
        f"check the path (relative to {os.getcwd()!r}) or use an absolute glob"
    raise MissingDatasetError(f"data.source='files:{pattern}' matches no files; {where}")
  return files


def _parquet_texts(source, text_key: str, name: str | None = None) -> Iterator[str]:
  import pyarrow.parquet as pq
  pf = pq.ParquetFile(source)
  name = name or str(source)
  if text_key not in pf.schema_arrow.names:
    raise KeyError(f"{name} has no column {text_key!r} (columns: {pf.schema_arrow.names}); "
                   f"set data.text_key")
  for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
    for text in batch.column(0).to_pylist():
      if text is not None:
        yield text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


def _glob_root(pattern: str) -> str:
  """The directory part of a glob before its first wildcard (paths are named relative to
  it, so moving the whole folder keeps every document in its split)."""
  sep = "/" if is_remote(pattern) else os.sep
  parts = (pattern if is_remote(pattern) else os.path.expanduser(pattern)).split(sep)
  fixed = [p for p in parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)]]
  return sep.join(fixed) or "."


def _rel(path: str, root: str) -> str:
  return path[len(root):].lstrip("/") if is_remote(path) else os.path.relpath(path, root)


@dataclasses.dataclass(frozen=True)
class Unit:
  """A piece of a source that one worker reads alone.

  kind 'stdlib' / 'text': a whole file, one document; 'jsonl': the lines of `path` that
  start in bytes [start, stop); 'parquet': rows [start, stop); 'tfds': records [start,
  stop) of tfds split `path`, all in our split `rel`. `rel` is what the train/validation
  hash is taken of (a path relative to the source's root), so it does not depend on
  where the files live or on how the source was cut.
  """
  kind: str
  path: str
  rel: str
  start: int = 0
  stop: int = 0
  size: int = 0   # bytes to read, about (progress, and whether a process pool pays)


def _ranges(total: int, pieces: int) -> list[tuple[int, int]]:
  pieces = max(1, min(pieces, total))
  return [(total * i // pieces, total * (i + 1) // pieces) for i in range(pieces)]


def _file_units(pattern: str, pieces: int) -> list[Unit]:
  root, out = _glob_root(pattern), []
  for path in matching_files(pattern):
    rel = _rel(path, root)
    if path.endswith((".jsonl", ".json")):
      size = _size_and_time(path)[0]
      n = max(min(pieces, -(-size // MIN_CHUNK_BYTES)), -(-size // MAX_CHUNK_BYTES), 1)
      out += [Unit("jsonl", path, rel, a, b, b - a) for a, b in _ranges(size, n)]
    elif path.endswith(".parquet"):
      import pyarrow.parquet as pq
      with _open(path) as f:
        rows = pq.ParquetFile(f).metadata.num_rows
      size = _size_and_time(path)[0]
      out += [Unit("parquet", path, rel, a, b, size * (b - a) // max(rows, 1)) for a, b in _ranges(rows, pieces)]
    else:
      out.append(Unit("text", path, rel, size=_size_and_time(path)[0]))
  return out


def units(cfg, pieces: int) -> list[Unit]:
  """cfg.source cut into units, in a fixed order: every file, JSON-lines and Parquet
  files into up to `pieces` parts (preparation passes the shard count, so even a single
  file gives every shard documents), tfds splits into `pieces` record ranges each."""
  if cfg.source == "stdlib":
    root = stdlib_root()
    return [Unit("stdlib", os.path.join(root, rel), rel, size=os.path.getsize(os.path.join(root, rel)))
            for rel in stdlib_files(root)]
  if cfg.source.startswith("files:"):
    return _file_units(cfg.source[len("files:"):], pieces)
  if cfg.source.startswith("tfds:"):
    builder = tfds_builder(cfg.source[len("tfds:"):], cfg.data_dir)
    out = []
    for split in SPLITS:
      name = resolve_split(builder, split)
      out += [Unit("tfds", name, split, a, b)
              for a, b in _ranges(builder.info.splits[name].num_examples, pieces)]
    return out
  raise ValueError(f"data.source={cfg.source!r} is not a text source")


def _jsonl_range(unit: Unit, text_key: str) -> Iterator[tuple[str, str]]:
  """(key, text) of the lines that start in [start, stop): a range begins after the line
  that straddles its start, so neighbouring ranges share no line."""
  with _open(unit.path) as f:
    offset = unit.start
    if offset > 0:
      f.seek(offset - 1)
      offset += len(f.readline()) - 1
    while offset < unit.stop:
      line = f.readline()
      if not line:
        return
      key, offset = f"{unit.rel}@{offset}", offset + len(line)
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{unit.path} at byte {offset - len(line)} is not a JSON line ({e})") from e
      if not isinstance(row, dict) or text_key not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise KeyError(f"{unit.path} at byte {offset - len(line)} has no field {text_key!r} "
                       f"(fields: {keys}); set data.text_key")
      yield key, str(row[text_key])


def unit_documents(cfg, unit: Unit) -> Iterator[tuple[str, str]]:
  """(split, text) of every document of a unit, in order."""
  f = cfg.validation_fraction
  if unit.kind in ("stdlib", "text"):
    text = read_source(unit.path)
    yield split_of(unit.rel if unit.kind == "stdlib" else f"{unit.rel}:0", f), text
  elif unit.kind == "jsonl":
    for key, text in _jsonl_range(unit, cfg.text_key):
      yield split_of(key, f), text
  elif unit.kind == "parquet":
    with _open(unit.path) as fh:
      for i, text in enumerate(_parquet_texts(fh, cfg.text_key, unit.path)):
        if i >= unit.stop:
          return
        if i >= unit.start:
          yield split_of(f"{unit.rel}:{i}", f), text
  elif unit.kind == "tfds":
    builder = tfds_builder(cfg.source[len("tfds:"):], cfg.data_dir)
    records = builder.as_data_source(split=unit.path)
    for text in _tfds_texts(records, cfg.text_key, unit.start, unit.stop):
      yield unit.rel, text
  else:
    raise ValueError(f"unknown unit kind {unit.kind!r}")


# --- one interface over all text sources -------------------------------------------------

def documents(cfg, split: str) -> Iterator[str]:
  """The texts of one split of cfg.source, in unit order, one at a time (a tokenizer's
  training text; tests)."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}")
  for unit in units(cfg, cfg.num_shards):
    if unit.kind == "tfds" and unit.rel != split:
      continue
    for s, text in unit_documents(cfg, unit):
      if s == split:
        yield text


def _tfds_texts(records, text_key: str, start: int = 0, stop: int | None = None,
                chunk: int = 1024) -> Iterator[str]:
  """Texts of records [start, stop), read in chunks (`__getitems__`) to amortize ArrayRecord reads."""
  stop = len(records) if stop is None else stop
  for first in range(start, stop, chunk):
    idx = list(range(first, min(first + chunk, stop)))
    rows = records.__getitems__(idx) if hasattr(records, "__getitems__") else [records[i] for i in idx]
    for row in rows:
      if text_key not in row:
        raise KeyError(f"records have no field {text_key!r} (fields: {sorted(row)}); "
                       f"set data.text_key")
      text = row[text_key]
      yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)


def fingerprint(cfg) -> str:
  """What the source holds right now: changes when its content (or split) would."""
  if cfg.source == "stdlib":
    root, v = stdlib_root(), sys.version_info
    digest = _files_digest(stdlib_files(root), root)
    return f"stdlib {sys.implementation.name}{v.major}.{v.minor}.{v.micro} {root} {digest}"
  if cfg.source.startswith("files:"):
    return f"{cfg.source} {_files_digest(matching_files(cfg.source[len('files:'):]))}"
  if cfg.source.startswith("tfds:"):
    builder = tfds_builder(cfg.source[len("tfds:"):], cfg.data_dir)
    sizes = {k: v.num_examples for k, v in builder.info.splits.items()}
    return f"{builder.info.full_name} {sorted(sizes.items())}"
  raise ValueError(f"data.source={cfg.source!r} is not a text source")
