"""Preparation: a text source, tokenized once into sharded ArrayRecord files with a manifest.

    data_dir/prepared/<source>-<tokenizer>-<digest>/
      manifest.json                       tokenizer, source fingerprint, counts per split/shard
      tokenizer.model | tokenizer.json    the tokenizer the shards were made with (spm / hf)
      train-00000-of-00008.array_record   one record per document: its token ids (uint16/32)
      ...
      validation-00000-of-00008.array_record

The digest covers the source's fingerprint (file names, sizes, times), the tokenizer spec
(and file content), the split fraction, the text key and the shard count, so a later run
with the same config reuses the directory and any change prepares a new one. Documents
go round-robin to the shards, one at a time: memory does not grow with the corpus.
Preparation writes into a temporary directory and renames it when complete, under a file
lock, so racing processes (every host of a job) prepare once and the others reuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from typing import Any

import numpy as np

from shardax.trainer.data import sources, tokenizers

FORMAT = 1
SPM_TRAIN_MAX_BYTES = 4_000_000  # text a trained SentencePiece vocabulary sees at most (its
# training time grows quickly with it: ~1 min for 4 MB on a 2-core CPU)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A prepared directory and its manifest."""
  directory: str
  manifest: dict[str, Any]

  def shard_paths(self, split: str) -> list[str]:
    return [os.path.join(self.directory, s["file"]) for s in self.manifest["splits"][split]["shards"]]

  def split_counts(self, split: str) -> dict[str, int]:
    """{'documents', 'tokens', 'bytes'} of a split (bytes: utf-8 of the documents)."""
    return {k: self.manifest["splits"][split][k] for k in ("documents", "tokens", "bytes")}

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.manifest["dtype"])

  def tokenizer(self) -> tokenizers.Tokenizer:
    """The tokenizer the shards were made with (its copy in this directory)."""
    return tokenizers.from_file(self.manifest["tokenizer_file"], self.directory)


def load_tokenizer(data_cfg) -> tokenizers.Tokenizer:
  """The tokenizer of a DataConfig, as the prepared data uses it (the file stored beside
  the prepared shards for spm/hf, so a run and its decoding always agree). Here, above
  tokenizers.py, because it may have to prepare the data first (spm:train)."""
  if data_cfg.tokenizer == "byte" or data_cfg.source == "synthetic":
    return tokenizers.ByteTokenizer()
  if data_cfg.tokenizer.startswith(tokenizers.HF_MODEL_PREFIX):   # a model's own file
    return tokenizers.from_spec(data_cfg.tokenizer)
  return prepare_components(data_cfg)[0].tokenizer()


def _tokenizer_identity(spec: str) -> str:
  """The spec plus the content hash of a tokenizer file (a retrained file is a new one)."""
  path = None
  if spec.startswith("spm:") and not spec.startswith(tokenizers.SPM_TRAIN_PREFIX):
    path = spec[4:]
  elif spec.startswith(tokenizers.HF_MODEL_PREFIX):
    path = spec[len(tokenizers.HF_MODEL_PREFIX):]
  elif spec.startswith("hf:") or spec.endswith(".json"):
    path = spec[3:] if spec.startswith("hf:") else spec
  if path is None:
    return spec
  path = os.path.expanduser(path)
  if not os.path.exists(path):
    raise tokenizers.TokenizerError(f"data.tokenizer={spec!r}: {path!r} does not exist")
  with open(path, "rb") as f:
    return f"{spec} {hashlib.sha256(f.read()).hexdigest()[:16]}"


def slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:40]


def prepared_dir(cfg) -> tuple[str, dict[str, Any]]:
  """(directory, identity) of cfg's prepared data; nothing is written."""
  identity = {"format": FORMAT, "source": cfg.source, "source_fingerprint": sources.fingerprint(cfg),
              "tokenizer": _tokenizer_identity(cfg.tokenizer), "text_key": cfg.text_key,
              "validation_fraction": cfg.validation_fraction, "num_shards": cfg.num_shards}
  digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
  name = f"{slug(cfg.source)}-{slug(cfg.tokenizer.split('/')[-1])}-{digest}"
  return os.path.join(os.path.expanduser(cfg.data_dir), "prepared", name), identity


@contextlib.contextmanager
def _file_lock(path: str):
  """An exclusive flock so racing processes prepare once (local filesystems only)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _read(directory: str) -> Prepared | None:
  path = os.path.join(directory, "manifest.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return Prepared(directory, json.load(f))


def prepare_components(cfg) -> list[Prepared]:
  """The prepared set of every source cfg reads (a mixture: one per source, each with its
  own manifest and shards), checked to share one tokenizer: a mixture's documents are
  packed into the same windows, so their ids must mean the same pieces."""
  sets = [prepare(cfg.for_source(src) if cfg.mixture else cfg) for src, _ in cfg.components]
  def key(p: Prepared):
    return tuple(p.manifest.get(k) for k in ("tokenizer", "vocab_size", "eos_id", "own_start", "dtype"))
  for (src, _), p in zip(cfg.components, sets):
    if key(p) != key(sets[0]):
      raise tokenizers.TokenizerError(
          f"data.mixture: {src!r} was prepared with tokenizer {p.manifest.get('tokenizer')!r} but "
          f"{cfg.components[0][0]!r} with {sets[0].manifest.get('tokenizer')!r}; a mixture needs "
          f"one tokenizer file for every source (data.tokenizer)")
  return sets


def prepare(cfg) -> Prepared:
  """cfg's prepared data, made now if it does not exist yet (cached per process)."""
  if getattr(cfg, "mixture", ()):
    raise ValueError("a mixture has one prepared set per source: use prepare_components(cfg)")
  return _prepare(cfg.source, os.path.expanduser(cfg.data_dir), cfg.text_key,
                  cfg.validation_fraction, cfg.tokenizer, cfg.num_shards)


@functools.lru_cache(maxsize=16)
def _prepare(source, data_dir, text_key, validation_fraction, tokenizer, num_shards) -> Prepared:
  cfg = _Fields(source, data_dir, text_key, validation_fraction, tokenizer, num_shards)
  directory, identity = prepared_dir(cfg)
  found = _read(directory)
  if found is not None:
    return found
  with _file_lock(directory + ".lock"):
    found = _read(directory)  # another process may have finished meanwhile
    if found is not None:
      return found
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    manifest = _write(cfg, tmp, identity)
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
      json.dump(manifest, f, indent=1)
    os.rename(tmp, directory)
  return Prepared(directory, manifest)


@dataclasses.dataclass(frozen=True)
class _Fields:
  """The DataConfig fields preparation depends on (hashable: the cache key)."""
  source: str
  data_dir: str
  text_key: str
  validation_fraction: float
  tokenizer: str
  num_shards: int


def _make_tokenizer(cfg, directory: str) -> tuple[tokenizers.Tokenizer, str | None]:
  """The tokenizer, its file trained or copied into `directory`; (tokenizer, file name)."""
  vocab = tokenizers.trained_vocab(cfg.tokenizer)
  if vocab is not None:
    print(f"training a {vocab}-piece SentencePiece vocabulary on {cfg.source} (train split)",
          file=sys.stderr, flush=True)
    tokenizers.train_sentencepiece(sources.documents(cfg, "train"), vocab,
                                   os.path.join(directory, "tokenizer"), SPM_TRAIN_MAX_BYTES)
    return tokenizers.from_spec(cfg.tokenizer, directory), "tokenizer.model"
  tok = tokenizers.from_spec(cfg.tokenizer)
  if isinstance(tok, tokenizers.ByteTokenizer):
    return tok, None
  name = ("tokenizer.model" if isinstance(tok, tokenizers.SentencePieceTokenizer) else
          tokenizers.HF_MODEL_FILE if tok.own_start else "tokenizer.json")
  shutil.copy(tok.path, os.path.join(directory, name))
  return tok, name


def _write(cfg, directory: str, identity: dict[str, Any]) -> dict[str, Any]:
  """Tokenizes every split into `directory`; returns the manifest."""
  from array_record.python.array_record_module import ArrayRecordWriter
  from tqdm import tqdm
  t0 = time.perf_counter()
  tok, tok_file = _make_tokenizer(cfg, directory)
  t_tok = time.perf_counter()
  dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
  splits = {}
  for split in sources.SPLITS:
    n = cfg.num_shards
    names = [f"{split}-{i:05d}-of-{n:05d}.array_record" for i in range(n)]
    writers = [ArrayRecordWriter(os.path.join(directory, f), "group_size:1") for f in names]
    shards = [{"file": f, "documents": 0, "tokens": 0, "bytes": 0} for f in names]
    bar = tqdm(desc=f"preparing {split}", unit="B", unit_scale=True, file=sys.stderr,
               mininterval=1.0, disable=None)
    for i, text in enumerate(sources.documents(cfg, split)):
      ids = tok.encode_array(text, dtype)
      size = len(text.encode("utf-8"))
      shard = shards[i % n]
      writers[i % n].write(ids.tobytes())
      shard["documents"] += 1
      shard["tokens"] += int(ids.size)
      shard["bytes"] += size
      bar.update(size)
    bar.close()
    for w in writers:
      w.close()
    totals = {k: sum(s[k] for s in shards) for k in ("documents", "tokens", "bytes")}
    if totals["documents"] == 0:
      raise sources.MissingDatasetError(
          f"data.source={cfg.source!r} has no {split} documents (validation_fraction="
          f"{cfg.validation_fraction}); add documents or change data.validation_fraction")
    splits[split] = {**totals, "shards": shards}
  seconds, tokenizing = time.perf_counter() - t0, time.perf_counter() - t_tok
  total_bytes = sum(s["bytes"] for s in splits.values())
  trained = f", {seconds - tokenizing:.1f} s of it training the tokenizer" if seconds - tokenizing > 0.5 else ""
  print(f"prepared {total_bytes / 1e6:.1f} MB of text in {seconds:.1f} s{trained}; tokenized and "
        f"written at {total_bytes / 1e6 / tokenizing:.2f} MB/s into {directory.rsplit('.tmp-', 1)[0]}",
        file=sys.stderr, flush=True)
  return {**identity, "tokenizer_file": tok_file, "vocab_size": tok.vocab_size,
          "eos_id": tok.eos_id, "pad_id": tok.pad_id, "own_start": tok.own_start, "dtype": dtype.name, "splits": splits,
          "seconds": round(seconds, 2), "tokenizer_seconds": round(seconds - tokenizing, 2),
          "bytes_per_s": round(total_bytes / tokenizing)}
