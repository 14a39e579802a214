"""Preparation: a text source, tokenized once per job into sharded ArrayRecord files.

    data_dir/prepared/<source>-<tokenizer>-<digest>/      (data_dir: local, or gs://...)
      manifest.json                       tokenizer, source fingerprint, counts per split/shard
      tokenizer.model | tokenizer.json    the tokenizer the shards were made with (spm / hf)
      train-00000-of-00008.array_record   one record per document: its token ids (uint16/32)
      ...
      validation-00000-of-00008.array_record
      shards/00000.json ...               one per shard: its counts, written once it is in place

The digest covers the source's fingerprint (file names, sizes, times), the tokenizer spec
(and file content), the split fraction, the text key and the shard count, so a later run
with the same config reuses the directory and any change prepares a new one.

Once per job, in parallel, anywhere: the source is cut into units (sources.units: files,
byte ranges of JSON-lines files, ...); unit j goes to shard j mod N, whole, in order, so
the output is the same whatever the number of processes and hosts. Process i of n writes
shards i, i+n, ... (it reads only their units; n is the job's process count for a gs://
data_dir, 1 for a local one, which may be a host's own disk), tokenizing them on every core with a
process pool (tokenizers hold the GIL: threads would not help). A shard is written
locally, moved into place in one step (store.publish) and then its counts file; every
process waits until all N counts exist and commits the manifest with
store.create_if_absent: the first commit wins and every process, and any independent
job preparing the same source at the same time, returns that one manifest. Output being
deterministic, two writers of one shard write the same bytes. A preparer that died
leaves finished shards behind; the next run writes only the missing ones.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

from shardax.trainer.data import sources, store, tokenizers

FORMAT = 2
SPM_TRAIN_MAX_BYTES = 4_000_000  # text a trained SentencePiece vocabulary sees at most (its
# training time grows quickly with it: ~1 min for 4 MB on a 2-core CPU)
POOL_MIN_BYTES = 8 << 20   # below this a process pool costs more (spawn + imports) than it saves
WAIT_S = float(os.environ.get("SHARDAX_PREPARE_WAIT_S", 6 * 3600))  # for other hosts' shards


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A prepared directory (local path or URL) and its manifest."""
  directory: str
  manifest: dict[str, Any]

  def shard_paths(self, split: str) -> list[str]:
    return [store.join(self.directory, s["file"]) for s in self.manifest["splits"][split]["shards"]]

  def split_counts(self, split: str) -> dict[str, int]:
    """{'documents', 'tokens', 'bytes'} of a split (bytes: utf-8 of the documents)."""
    return {k: self.manifest["splits"][split][k] for k in ("documents", "tokens", "bytes")}

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.manifest["dtype"])

  def tokenizer(self) -> tokenizers.Tokenizer:
    """The tokenizer the shards were made with (its copy in this directory)."""
    name = self.manifest["tokenizer_file"]
    if name is None:
      return tokenizers.ByteTokenizer()
    local = store.local_copy(store.join(self.directory, name))   # same base name
    return tokenizers.from_file(name, os.path.dirname(local))


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
  root = cfg.data_dir if store.is_remote(cfg.data_dir) else os.path.abspath(os.path.expanduser(cfg.data_dir))
  return store.join(root, "prepared", name), identity


def _read(directory: str) -> Prepared | None:
  path = store.join(directory, "manifest.json")
  if not store.exists(path):
    return None
  return Prepared(directory, json.loads(store.read_bytes(path)))


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


def prepare(cfg, processes: int | None = None, process_index: int | None = None,
            process_count: int | None = None) -> Prepared:
  """cfg's prepared data, made now if it does not exist yet (cached per process).

  processes: tokenizing processes on this host (None: every core, for inputs over
  POOL_MIN_BYTES); process_index / process_count: this host's share (None: jax's for a
  gs:// data_dir, all of it for a local one).
  """
  if getattr(cfg, "mixture", ()):
    raise ValueError("a mixture has one prepared set per source: use prepare_components(cfg)")
  return _prepare(_Fields(cfg.source, cfg.data_dir, cfg.text_key, cfg.validation_fraction,
                          cfg.tokenizer, cfg.num_shards), processes, process_index, process_count)


@dataclasses.dataclass(frozen=True)
class _Fields:
  """The DataConfig fields preparation depends on (hashable: the cache key; picklable:
  what a worker process gets)."""
  source: str
  data_dir: str
  text_key: str
  validation_fraction: float
  tokenizer: str
  num_shards: int


def _host_share(data_dir: str) -> tuple[int, int]:
  """(index, count) of this process's share: jax's for an object-store data_dir (one copy
  every host sees); (0, 1) for a local path, which may be each host's own disk: there
  every host prepares all shards (on a shared disk they race and agree, see above)."""
  if "jax" not in sys.modules or not store.is_remote(data_dir):
    return 0, 1
  import jax
  return jax.process_index(), jax.process_count()


@functools.lru_cache(maxsize=16)
def _prepare(cfg: _Fields, processes, process_index, process_count) -> Prepared:
  directory, identity = prepared_dir(cfg)
  found = _read(directory)
  if found is not None:
    return found
  if process_index is None or process_count is None:
    process_index, process_count = _host_share(cfg.data_dir)
  t0 = time.perf_counter()
  units = sources.units(cfg, cfg.num_shards)
  tok_file = _commit_tokenizer(cfg, directory, process_index == 0)
  t_tok = time.perf_counter()
  n = cfg.num_shards
  mine = [k for k in range(process_index, n, process_count)
          if not store.exists(store.join(directory, "shards", f"{k:05d}.json"))]
  jobs = [_ShardJob(cfg, directory, k, tuple(units[k::n]), tok_file) for k in mine]
  done_bytes, used, busy = _run(jobs, processes)
  counts = _wait_for_shards(directory, n, process_index, process_count)
  seconds, tokenizing = time.perf_counter() - t0, max(time.perf_counter() - t_tok, 1e-9)
  manifest = {**identity, **_manifest(cfg, directory, counts, tok_file), "seconds": round(seconds, 2),
              "tokenizer_seconds": round(t_tok - t0, 2), "processes": used,
              "bytes_per_s": round(done_bytes / tokenizing),   # wall: all processes, pool start-up included
              "bytes_per_s_per_process": round(done_bytes / max(busy, 1e-9))}
  store.create_if_absent(store.join(directory, "manifest.json"), json.dumps(manifest, indent=1).encode())
  trained = f", {t_tok - t0:.1f} s of it training the tokenizer" if t_tok - t0 > 0.5 else ""
  print(f"prepared {done_bytes / 1e6:.1f} MB of text ({len(jobs)} of {n} shards, process "
        f"{process_index} of {process_count}) in {seconds:.1f} s{trained} with {used} "
        f"process(es); tokenized and written at {done_bytes / 1e6 / tokenizing:.2f} MB/s into "
        f"{directory}", file=sys.stderr, flush=True)
  return _read(directory)   # the committed manifest, whoever wrote it


def _commit_tokenizer(cfg: _Fields, directory: str, train: bool) -> str | None:
  """The tokenizer file's name in `directory` (None: bytes), committed once: trained
  (spm:train, by process 0; the others wait for it) or copied from the spec's file."""
  vocab = tokenizers.trained_vocab(cfg.tokenizer)
  if vocab is not None:
    dst = store.join(directory, "tokenizer.model")
    if train and not store.exists(dst):
      print(f"training a {vocab}-piece SentencePiece vocabulary on {cfg.source} (train split)",
            file=sys.stderr, flush=True)
      tmp = tempfile.mkdtemp(prefix="shardax-spm-")
      try:
        path = tokenizers.train_sentencepiece(sources.documents(cfg, "train"), vocab,
                                              os.path.join(tmp, "tokenizer"), SPM_TRAIN_MAX_BYTES)
        with open(path, "rb") as f:
          store.create_if_absent(dst, f.read())
      finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _wait(lambda: store.exists(dst), f"the trained tokenizer {dst} (process 0 trains it)")
    return "tokenizer.model"
  tok = tokenizers.from_spec(cfg.tokenizer)
  if isinstance(tok, tokenizers.ByteTokenizer):
    return None
  name = ("tokenizer.model" if isinstance(tok, tokenizers.SentencePieceTokenizer) else
          tokenizers.HF_MODEL_FILE if tok.own_start else "tokenizer.json")
  with open(tok.path, "rb") as f:
    store.create_if_absent(store.join(directory, name), f.read())
  return name


@dataclasses.dataclass(frozen=True)
class _ShardJob:
  """Shard k of a prepared set: its units and where everything goes (picklable)."""
  cfg: _Fields
  directory: str
  k: int
  units: tuple[sources.Unit, ...]
  tok_file: str | None

  @property
  def size(self) -> int:
    return sum(u.size for u in self.units)


def _run(jobs: list[_ShardJob], processes: int | None) -> tuple[int, int, float]:
  """Writes the jobs' shards, on a process pool when it pays; (text bytes, processes,
  seconds of work summed over the processes: bytes / that = the rate of one process)."""
  from tqdm import tqdm
  if processes is None:
    processes = (os.cpu_count() or 1) if sum(j.size for j in jobs) >= POOL_MIN_BYTES else 1
  processes = max(1, min(processes, len(jobs)))
  bar = tqdm(desc="preparing", unit="B", unit_scale=True, file=sys.stderr, mininterval=1.0,
             disable=None, total=sum(j.size for j in jobs) or None)
  total, busy = 0, 0.0
  try:
    if processes == 1:
      for job in jobs:
        size, seconds = _write_shard(job, bar.update)
        total, busy = total + size, busy + seconds
    else:   # not fork: the parent may hold jax's threads, which fork would copy mid-flight.
      # A fork server is a fresh process that imports this module once, then forks the
      # workers from itself: one import (~2 s) instead of one per worker.
      ctx = multiprocessing.get_context("forkserver")
      ctx.set_forkserver_preload([__name__])
      with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        for done in concurrent.futures.as_completed([pool.submit(_write_shard, j) for j in jobs]):
          size, seconds = done.result()
          total, busy = total + size, busy + seconds
          bar.update(size)
  finally:
    bar.close()
  return total, processes, busy


def _tokenizer_for(job: _ShardJob) -> tokenizers.Tokenizer:
  if job.tok_file is None:
    return tokenizers.ByteTokenizer()
  local = store.local_copy(store.join(job.directory, job.tok_file))   # same base name
  return tokenizers.from_file(job.tok_file, os.path.dirname(local))


def _write_shard(job: _ShardJob, progress=None) -> tuple[int, float]:
  """Tokenizes shard k's units into its train and validation files, moves them into
  place, then writes its counts (the sign that the shard is complete); (text bytes
  read, seconds it took this process)."""
  from array_record.python.array_record_module import ArrayRecordWriter
  t0 = time.perf_counter()
  tok = _tokenizer_for(job)
  dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
  n = job.cfg.num_shards
  names = {s: f"{s}-{job.k:05d}-of-{n:05d}.array_record" for s in sources.SPLITS}
  tmps = {s: store.temp_beside(store.join(job.directory, names[s])) for s in sources.SPLITS}
  writers = {s: ArrayRecordWriter(tmps[s], "group_size:1") for s in sources.SPLITS}
  counts = {s: {"file": names[s], "documents": 0, "tokens": 0, "bytes": 0} for s in sources.SPLITS}
  try:
    for unit in job.units:
      for split, text in sources.unit_documents(job.cfg, unit):
        ids = tok.encode_array(text, dtype)
        writers[split].write(ids.tobytes())
        c, size = counts[split], len(text.encode("utf-8"))
        c["documents"], c["tokens"], c["bytes"] = c["documents"] + 1, c["tokens"] + int(ids.size), c["bytes"] + size
        if progress is not None:
          progress(size)
    for s in sources.SPLITS:
      writers[s].close()
      store.publish(tmps[s], store.join(job.directory, names[s]))
  finally:
    for t in tmps.values():
      if os.path.exists(t):
        os.remove(t)
  marker = store.join(job.directory, "shards", f"{job.k:05d}.json")
  tmp = store.temp_beside(marker)
  with open(tmp, "w") as f:
    json.dump({"dtype": dtype.name, "splits": counts}, f)
  store.publish(tmp, marker)
  return sum(c["bytes"] for c in counts.values()), time.perf_counter() - t0


def _wait(ready, what: str) -> None:
  t0 = last = time.monotonic()
  while not ready():
    if time.monotonic() - t0 > WAIT_S:
      raise TimeoutError(f"waited {WAIT_S:.0f} s for {what}; is every process of the job "
                         f"preparing the same data config? (SHARDAX_PREPARE_WAIT_S sets the wait)")
    if time.monotonic() - last > 60:
      print(f"waiting for {what}", file=sys.stderr, flush=True)
      last = time.monotonic()
    time.sleep(0.5)


def _wait_for_shards(directory: str, n: int, index: int, count: int) -> list[dict]:
  """Every shard's counts, once all are written (by this process and the others)."""
  paths = [store.join(directory, "shards", f"{k:05d}.json") for k in range(n)]
  _wait(lambda: all(store.exists(p) for p in paths),
        f"the shards of {directory} that other processes write (process k % {count} writes shard k; "
        f"this is process {index})")
  return [json.loads(store.read_bytes(p)) for p in paths]


def _manifest(cfg: _Fields, directory: str, shards: list[dict], tok_file: str | None) -> dict[str, Any]:
  """The manifest's counts and tokenizer fields, from every shard's counts file."""
  tok = _tokenizer_for(_ShardJob(cfg, directory, 0, (), tok_file))
  splits = {}
  for split in sources.SPLITS:
    per = [s["splits"][split] for s in shards]
    totals = {k: sum(s[k] for s in per) for k in ("documents", "tokens", "bytes")}
    if totals["documents"] == 0:
      raise sources.MissingDatasetError(
          f"data.source={cfg.source!r} has no {split} documents (validation_fraction="
          f"{cfg.validation_fraction}); add documents or change data.validation_fraction")
    splits[split] = {**totals, "shards": per}
  return {"tokenizer_file": tok_file, "dtype": shards[0]["dtype"], "splits": splits,
          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "pad_id": tok.pad_id,
          "own_start": tok.own_start}
