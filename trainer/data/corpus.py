"""Text corpora as byte-token streams, read from local tfds ArrayRecord datasets.

Why tfds + ArrayRecord: a prepared dataset is a versioned directory that later runs
reuse, and `builder.as_data_source()` gives random access to its records WITHOUT
TensorFlow (tfds' `load`/`as_dataset` and the tfrecord format need TensorFlow).

The default corpus is the Python standard library's own sources: always present, a
few tens of MB, and real text with structure a small LM can learn. It is prepared once
under `data_dir` by `prepare_stdlib`:

    data_dir/shardax_stdlib_text/<cpython3_11_7_val0p05_<digest>>/1.0.0/*.array_record*

The config name carries the Python version, the validation fraction and a digest of
the file list, so a different stdlib or split never reuses stale data.

Tokens are bytes (ids 0..255). Id 0 (`SEPARATOR_ID`, NUL) separates documents; NUL
bytes inside a document are dropped so the id stays unambiguous.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import io
import logging
import os
import sys
import sysconfig
import tokenize
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

SEPARATOR_ID = 0
BYTE_VOCAB = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


class _QuietCustomConfig(logging.Filter):
  """tfds warns 'Using custom data configuration' on every construction of a builder whose
  config is made at run time (ours: it names the Python version); that is by design here."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Using custom data configuration: StdlibConfig")


logging.getLogger("absl").addFilter(_QuietCustomConfig())


class MissingDatasetError(FileNotFoundError):
  """A tfds dataset that is not prepared under data_dir (the message says how to fix it)."""


# --- byte tokenizer -------------------------------------------------------------------

def encode(text: str) -> np.ndarray:
  """utf-8 bytes of `text` as int32 ids in 1..255 (NUL dropped: id 0 is the separator)."""
  data = text.encode("utf-8").replace(b"\0", b"")
  return np.frombuffer(data, dtype=np.uint8).astype(np.int32)


def decode(ids: Any) -> str:
  """Inverse of `encode`; separators and ids outside 1..255 (a padded vocab) are dropped."""
  ids = np.asarray(ids).reshape(-1)
  ids = ids[(ids > SEPARATOR_ID) & (ids < BYTE_VOCAB)]
  return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# --- the stdlib corpus ------------------------------------------------------------------

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


def _files_digest(root: str, files: list[str]) -> str:
  h = hashlib.sha256()
  for rel in files:
    h.update(f"{rel}\0{os.path.getsize(os.path.join(root, rel))}\n".encode())
  return h.hexdigest()[:8]


@dataclasses.dataclass(eq=False)
class StdlibConfig(tfds.core.BuilderConfig):
  """Which stdlib (root) and which split fraction; both are part of the config name."""
  root: str = ""
  validation_fraction: float = 0.05


def stdlib_config(validation_fraction: float, root: str | None = None) -> StdlibConfig:
  root = root or stdlib_root()
  v = sys.version_info
  frac = f"{validation_fraction:g}".replace(".", "p").replace("-", "m")
  name = (f"{sys.implementation.name}{v.major}_{v.minor}_{v.micro}_val{frac}_"
          f"{_files_digest(root, stdlib_files(root))}")
  return StdlibConfig(name=name, root=root, validation_fraction=validation_fraction,
                      description=f"*.py under {root}, {validation_fraction:g} held out")


class ShardaxStdlibText(tfds.core.GeneratorBasedBuilder):
  """The Python standard library's sources: {'path', 'text'} per file, split by path hash."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  # tfds looks for a checksums file next to the code; its lookup needs the optional
  # `importlib_resources` package under an editable install. Nothing is downloaded here,
  # so there are no checksums: say so instead.
  code_path = None

  def _info(self) -> tfds.core.DatasetInfo:
    # disable_shuffling keeps records in generation (= sorted path) order.
    return tfds.core.DatasetInfo(
        builder=self,
        description="Python standard library *.py sources (shardax default corpus).",
        features=tfds.features.FeaturesDict(
            {"path": tfds.features.Text(), "text": tfds.features.Text()}),
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    return {s: self._generate_examples(s) for s in ("train", "validation")}

  def _generate_examples(self, split: str):
    cfg = self.builder_config
    for rel in stdlib_files(cfg.root):
      if split_of(rel, cfg.validation_fraction) == split:
        yield rel, {"path": rel, "text": read_source(os.path.join(cfg.root, rel))}


@contextlib.contextmanager
def _file_lock(path: str):
  """An exclusive flock: tfds prepares into a temp dir and renames, but a second
  process racing the same rename fails, so preparers queue here instead.

  Local (and flock-capable network) filesystems only; for an object store (gs://...)
  there is no lock: prepare once from one process before starting the job.
  """
  if "://" in path:
    yield
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare_stdlib(data_dir: str, validation_fraction: float,
                   root: str | None = None) -> ShardaxStdlibText:
  """The prepared stdlib builder; prepares it on first use (safe across racing processes)."""
  data_dir = os.path.expanduser(data_dir)
  config = stdlib_config(validation_fraction, root)
  builder = ShardaxStdlibText(config=config, data_dir=data_dir, file_format="array_record")
  if builder.is_prepared():
    return builder
  with _file_lock(os.path.join(data_dir, f"{builder.name}.{config.name}.lock")):
    builder = ShardaxStdlibText(config=config, data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():  # re-check: another process may have finished meanwhile
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
          try_download_gcs=False,  # would ask GCS over the network
          compute_stats=tfds.download.ComputeStatsMode.SKIP))  # stats need TensorFlow
  # A fresh builder reads the finished dataset_info (split sizes) from disk.
  return ShardaxStdlibText(config=config, data_dir=data_dir, file_format="array_record")


# --- any prepared tfds dataset ------------------------------------------------------------

def _how_to_prepare(name: str, data_dir: str) -> str:
  return (f"prepare it once with `tfds build {name} --data_dir={data_dir} "
          f"--file_format=array_record` (or `tfds.builder({name!r}, data_dir={data_dir!r})"
          f".download_and_prepare(file_format='array_record')`), then rerun")


def tfds_builder(name: str, data_dir: str):
  """The builder of a tfds dataset prepared (as ArrayRecord) under data_dir, or a clear error."""
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


# --- documents -> one token stream -------------------------------------------------------------

def token_stream(records: Sequence[Any], text_key: str, chunk: int = 1024) -> np.ndarray:
  """uint8 stream [SEP doc0 SEP doc1 ...] over records in index order (deterministic).

  uint8 (1 byte/token) because the whole split is held in host memory; fine up to a few
  GB of text. Records are read in chunks (`__getitems__`) to amortize ArrayRecord reads.
  """
  parts = []
  sep = bytes([SEPARATOR_ID])
  for start in range(0, len(records), chunk):
    idx = list(range(start, min(start + chunk, len(records))))
    rows = records.__getitems__(idx) if hasattr(records, "__getitems__") else [records[i] for i in idx]
    for row in rows:
      if text_key not in row:
        raise KeyError(f"records have no field {text_key!r} (fields: {sorted(row)}); "
                       f"set data.text_key")
      text = row[text_key]
      data = text if isinstance(text, bytes) else str(text).encode("utf-8")
      parts.append(sep)
      parts.append(data.replace(b"\0", b""))
  stream = np.frombuffer(b"".join(parts), dtype=np.uint8)
  return stream


@functools.lru_cache(maxsize=8)
def split_stream(source: str, data_dir: str, split: str, text_key: str,
                 validation_fraction: float) -> np.ndarray:
  """The token stream of one split of 'stdlib' or 'tfds:NAME', cached per process."""
  if source == "stdlib":
    builder, text_key = prepare_stdlib(data_dir, validation_fraction), "text"
  elif source.startswith("tfds:"):
    builder = tfds_builder(source[len("tfds:"):], data_dir)
    split = resolve_split(builder, split)
  else:
    raise ValueError(f"no token stream for data.source={source!r}")
  return token_stream(builder.as_data_source(split=split), text_key)
