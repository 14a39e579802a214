"""Per-host streaming of prepared documents: each reader opens only its share of the shards.

A "reader" owns a fixed block of rows of every global batch: R = gcd(num_shards,
global_batch) readers of B/R rows each, R fixed by the config and NOT by the number of
processes. A process runs the readers of the rows it holds (all R on one host, R/P on
each of P hosts; the readers its rows overlap when P does not divide R, keeping its rows:
layout.py), so the global batch is the same whatever the process count: a two-process
run computes what a one-process run computes. Reader r of R reads

    the shard files r, r+R, r+2R, ...   when R divides the shard count (only those are opened)
    records r, r+R, ... of all shards    otherwise (still disjoint, every file opened)

and nothing else, so its memory is the ArrayRecord readers plus grain's buffers, whatever
the size of the dataset. Training shuffles its documents per epoch (grain folds the epoch
into the seed) and repeats; validation reads them once in order. A mixture (data.mixture)
draws each reader's training documents from every source's shards by weight (grain's
MapDataset.mix); it is evaluated source by source. Documents are then packed
(packing.py) into windows and batched to the reader's rows. All of it is one grain
IterDataset whose state (a record index plus the packer's buffer position) is what a
checkpoint saves: a resumed run reads exactly what an uninterrupted one would.
Which readers a process runs, and which of their rows it keeps, is layout.py.

With `with_ids` (the document-id record, record.py; training only) every document carries its id
(source index, record index in its prepared split), packed beside its tokens as a
`document` field, so a batch says which documents it holds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import grain
import numpy as np

from shardax.trainer.data import packing, record, store
from shardax.trainer.data.layout import ReaderLayout
from shardax.trainer.data.preparation import Prepared

READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


def _ids(raw: bytes, dtype: np.dtype) -> np.ndarray:
  return np.frombuffer(raw, dtype=dtype)


def reader_files(paths: list[str], reader: int, readers: int) -> tuple[list[str], bool]:
  """(the shard files this reader opens, whether they are all its own): its own files
  r, r+R, ... when R divides the shard count, else all files (it then takes every R-th record)."""
  if len(paths) % readers == 0:
    return paths[reader::readers], True
  return paths, False


def local_documents(prepared: Prepared, split: str, reader: int, readers: int,
                    with_ids: int | None = None) -> grain.MapDataset:
  """This reader's documents (token-id arrays) of a split, in shard order; with_ids=k
  (source k of a mixture): (tokens, document id) pairs instead."""
  paths = prepared.shard_paths(split)
  files, own = reader_files(paths, reader, readers)
  # only this reader's files are opened (a gs:// set: copied to the local cache first)
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([store.local_copy(f) for f in files]))
  if not own:
    ds = ds[reader::readers]
  ds = ds.map(functools.partial(_ids, dtype=prepared.dtype))
  if with_ids is None:
    return ds
  return ds.map_with_index(_RecordIndex(prepared, split, reader, readers, own, with_ids))


class _RecordIndex:
  """(local index, tokens) -> (tokens, document id): the id names the document's index
  in its whole split (all shard files in order), so it does not depend on which reader
  reads it. A class, not a closure: grain's worker processes pickle it."""

  def __init__(self, prepared: Prepared, split: str, reader: int, readers: int, own: bool, source: int):
    counts = [s["documents"] for s in prepared.manifest["splits"][split]["shards"]]
    self._reader, self._readers, self._own, self._source = reader, readers, own, source
    self._starts = np.concatenate([[0], np.cumsum(counts)])        # of every file in the split
    self._files = list(range(len(counts)))[reader::readers]
    self._ends = np.cumsum([counts[f] for f in self._files])       # of this reader's files

  def index(self, i: int) -> int:
    if not self._own:   # every R-th record of all files
      return self._reader + i * self._readers
    j = int(np.searchsorted(self._ends, i, side="right"))
    return int(self._starts[self._files[j]] + i - (self._ends[j - 1] if j else 0))

  def __call__(self, i: int, tokens: np.ndarray):
    return tokens, record.document_id(self._source, self.index(i))


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """The last, short batch of a finite split filled up with all-padding windows."""
  have = len(batch["inputs"])
  if have == rows:
    return batch
  return {k: np.concatenate([v, np.zeros((rows - have,) + v.shape[1:], v.dtype)])
          for k, v in batch.items()}


def train_documents(prepared: Sequence[Prepared], weights: Sequence[float], seed: int,
                    reader: int, readers: int, with_ids: bool = False) -> grain.MapDataset:
  """This reader's endless training documents: each source's shuffled per epoch and
  repeated, then, for a mixture, drawn by weight with grain's `MapDataset.mix` (a fixed
  interleaving by index: the proportions hold over any stretch and the state stays one
  index, so a resumed run draws exactly what an uninterrupted one would)."""
  parts = []
  for i, p in enumerate(prepared):
    docs = local_documents(p, "train", reader, readers, with_ids=i if with_ids else None)
    if len(docs) == 0:
      raise ValueError(f"reader {reader} of {readers} has no training documents in "
                       f"{p.directory} ({len(p.shard_paths('train'))} shards); "
                       f"lower data.num_shards or add documents")
    parts.append(docs.shuffle(seed=(seed + i) % 2**32).repeat())
  return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, list(weights))


def _example(doc, eos: int, own_start: bool, with_ids: bool) -> dict[str, np.ndarray]:
  if not with_ids:
    return packing.document_example(doc, eos=eos, own_start=own_start)
  tokens, doc_id = doc
  ex = packing.document_example(tokens, eos=eos, own_start=own_start)
  return {**ex, "document": np.full(ex["inputs"].shape, doc_id, np.int64)}


def local_batches(prepared: Sequence[Prepared], split: str, seq_len: int, rows: int, seed: int,
                  reader: int, readers: int, weights: Sequence[float] = (1.0,),
                  with_ids: bool = False) -> grain.IterDataset:
  """This reader's batches {packing.FIELDS: [rows, seq_len]}: endless for 'train' (a
  mixture when several prepared sets are given), one pass over its documents (the last
  batch padded) for 'validation' (one prepared set)."""
  if split == "train":
    docs = train_documents(prepared, weights, seed, reader, readers, with_ids)
  else:
    (one,) = prepared
    docs = local_documents(one, split, reader, readers)   # ids are recorded for training only
  manifest = prepared[0].manifest   # a mixture's sets share the tokenizer (inputs checks)
  examples = docs.map(functools.partial(_example, eos=manifest["eos_id"],
                                        own_start=manifest.get("own_start", False), with_ids=with_ids))
  windows = packing.pack(examples.to_iter_dataset(READ_OPTIONS), seq_len, with_ids)
  batches = windows.batch(rows, drop_remainder=split == "train")
  return batches if split == "train" else batches.map(functools.partial(_pad_rows, rows=rows))


def _concat_rows(parts: Sequence[dict[str, np.ndarray]], keep: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
  """The readers' rows side by side, then the process's own rows of them (`keep`)."""
  rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  return rows if keep is None else {k: v[keep[0]:keep[1]] for k, v in rows.items()}


def train_batches(prepared: Sequence[Prepared], weights: Sequence[float], seq_len: int, seed: int,
                  layout: ReaderLayout, worker_count: int = 0, with_ids: bool = False) -> grain.IterDataset:
  """This process's training rows: its readers' batches side by side (grain zip: one
  checkpointable state; the map that keeps its rows adds nothing to it). With
  worker_count > 0 each reader gets `layout.workers_per_reader` worker processes of its
  own (grain's multiprocessing prefetch)."""
  parts = [local_batches(prepared, "train", seq_len, layout.per, seed, r, layout.readers, weights, with_ids)
           for r in layout.mine]
  if worker_count > 0:
    options = grain.MultiprocessingOptions(num_workers=layout.workers_per_reader(worker_count))
    parts = [p.mp_prefetch(options) for p in parts]
  keep = None if layout.read_factor == 1 else layout.keep
  if len(parts) == 1:
    return parts[0] if keep is None else parts[0].map(functools.partial(_concat_rows_of_one, keep=keep))
  return grain.experimental.ZipIterDataset(parts).map(functools.partial(_concat_rows, keep=keep))


def _concat_rows_of_one(batch: dict[str, np.ndarray], keep: tuple[int, int]) -> dict[str, np.ndarray]:
  return _concat_rows([batch], keep)


class PaddedReaders(grain.DatasetIterator):
  """This process's validation rows: its readers' batches side by side (its own rows of
  them), a reader that has run out giving all-padding rows, until every one has run out
  (then StopIteration)."""

  def __init__(self, prepared: Prepared, seq_len: int, layout: ReaderLayout):
    self._parts = [iter(local_batches([prepared], "validation", seq_len, layout.per, 0, r, layout.readers))
                   for r in layout.mine]
    pad = packing.padding_window(seq_len)
    self._pad = {k: np.stack([v] * layout.per) for k, v in pad.items()}
    self._keep = layout.keep
    super().__init__(self._parts)

  def __next__(self) -> dict[str, np.ndarray]:
    got = [next(p, None) for p in self._parts]
    if all(g is None for g in got):
      raise StopIteration
    return _concat_rows([self._pad if g is None else g for g in got], self._keep)

  def get_state(self):
    return {"readers": [p.get_state() for p in self._parts]}

  def set_state(self, state):
    for p, s in zip(self._parts, state["readers"]):
      p.set_state(s)
