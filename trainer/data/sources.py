"""Where documents come from: `data.source` -> an iterator of texts per split.

    stdlib      the Python standard library's *.py files (always present, ~30 MB of real
                text a small LM can learn); split by a stable hash of each path.
    tfds:NAME   any tfds dataset already prepared as ArrayRecord under data_dir, field
                `data.text_key` ('validation' falls back to 'test'); read without
                TensorFlow through `builder.as_data_source()`.
    files:GLOB  local files (`**` recurses): *.jsonl / *.json lines (field data.text_key),
                *.parquet (column data.text_key), anything else as one text document per
                file. Documents are split by a stable hash of "path:index".

A source is read once, in a deterministic order, by preparation.py, which tokenizes it
into sharded ArrayRecord files; training never reads a source directly. `fingerprint`
names what a source holds (file names, sizes, times; the tfds version), so a changed
source is prepared again instead of silently reusing stale data.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator

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
  with open(path, "rb") as f:
    data = f.read()
  try:
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)
  except (SyntaxError, LookupError, UnicodeDecodeError):
    return data.decode("utf-8", errors="replace")


def _files_digest(paths: list[str], root: str = "") -> str:
  """Names, sizes and modification times: a changed, added or removed file changes it."""
  h = hashlib.sha256()
  for rel in paths:
    st = os.stat(os.path.join(root, rel))
    h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
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
  """Sorted files matching `pattern` (recursive `**`), or a clear error."""
  if "://" in pattern:
    raise MissingDatasetError(f"data.source='files:{pattern}': object-store globs are not "
                              f"supported yet; copy the files to a local directory")
  files = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True)
                 if os.path.isfile(f))
  if not files:
    raise MissingDatasetError(f"data.source='files:{pattern}' matches no files; check the "
                              f"path (relative to {os.getcwd()!r}) or use an absolute glob")
  return files


def _jsonl_texts(path: str, text_key: str) -> Iterator[str]:
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n} is not a JSON line ({e})") from e
      if not isinstance(row, dict) or text_key not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise KeyError(f"{path}:{n} has no field {text_key!r} (fields: {keys}); set data.text_key")
      yield str(row[text_key])


def _parquet_texts(path: str, text_key: str) -> Iterator[str]:
  import pyarrow.parquet as pq
  pf = pq.ParquetFile(path)
  if text_key not in pf.schema_arrow.names:
    raise KeyError(f"{path} has no column {text_key!r} (columns: {pf.schema_arrow.names}); "
                   f"set data.text_key")
  for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
    for text in batch.column(0).to_pylist():
      if text is not None:
        yield text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


def file_texts(path: str, text_key: str) -> Iterator[str]:
  """The documents of one file, by extension."""
  if path.endswith((".jsonl", ".json")):
    return _jsonl_texts(path, text_key)
  if path.endswith(".parquet"):
    return _parquet_texts(path, text_key)
  return iter([read_source(path)])


def _glob_root(pattern: str) -> str:
  """The directory part of a glob before its first wildcard (paths are named relative to
  it, so moving the whole folder keeps every document in its split)."""
  parts = os.path.expanduser(pattern).split(os.sep)
  fixed = [p for p in parts[:next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts) - 1)]]
  return os.sep.join(fixed) or "."


def _files_documents(pattern: str, split: str, text_key: str, fraction: float) -> Iterator[str]:
  root = _glob_root(pattern)
  for path in matching_files(pattern):
    rel = os.path.relpath(path, root)
    for i, text in enumerate(file_texts(path, text_key)):
      if split_of(f"{rel}:{i}", fraction) == split:
        yield text


# --- one interface over all text sources -------------------------------------------------

def documents(cfg, split: str) -> Iterator[str]:
  """The texts of one split of cfg.source, in a deterministic order, one at a time."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}")
  if cfg.source == "stdlib":
    root = stdlib_root()
    return (read_source(os.path.join(root, rel)) for rel in stdlib_files(root)
            if split_of(rel, cfg.validation_fraction) == split)
  if cfg.source.startswith("files:"):
    return _files_documents(cfg.source[len("files:"):], split, cfg.text_key, cfg.validation_fraction)
  if cfg.source.startswith("tfds:"):
    builder = tfds_builder(cfg.source[len("tfds:"):], cfg.data_dir)
    return _tfds_texts(builder.as_data_source(split=resolve_split(builder, split)), cfg.text_key)
  raise ValueError(f"data.source={cfg.source!r} is not a text source")


def _tfds_texts(records, text_key: str, chunk: int = 1024) -> Iterator[str]:
  """Texts of tfds records, read in chunks (`__getitems__`) to amortize ArrayRecord reads."""
  for start in range(0, len(records), chunk):
    idx = list(range(start, min(start + chunk, len(records))))
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
