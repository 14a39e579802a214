"""Per-host streaming of prepared documents: each reader opens only its share of the shards.

A "reader" owns a fixed block of rows of every global batch: R = gcd(num_shards,
global_batch) readers of B/R rows each, R fixed by the config and NOT by the number of
processes. A process runs the readers of the rows it holds (all R on one host, R/P on
each of P hosts), so the global batch is the same whatever the process count: a
two-process run computes what a one-process run computes. Reader r of R reads

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
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import grain
import numpy as np
from absl import logging

from shardax.trainer.data import packing, store
from shardax.trainer.data.preparation import Prepared

READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


def _ids(record: bytes, dtype: np.dtype) -> np.ndarray:
  return np.frombuffer(record, dtype=dtype)


def reader_files(paths: list[str], reader: int, readers: int) -> tuple[list[str], bool]:
  """(the shard files this reader opens, whether they are all its own): its own files
  r, r+R, ... when R divides the shard count, else all files (it then takes every R-th record)."""
  if len(paths) % readers == 0:
    return paths[reader::readers], True
  return paths, False


def local_documents(prepared: Prepared, split: str, reader: int, readers: int) -> grain.MapDataset:
  """This reader's documents (token-id arrays) of a split, in shard order."""
  files, own = reader_files(prepared.shard_paths(split), reader, readers)
  # only this reader's files are opened (a gs:// set: copied to the local cache first)
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([store.local_copy(f) for f in files]))
  if not own:
    ds = ds[reader::readers]
  return ds.map(functools.partial(_ids, dtype=prepared.dtype))


def _pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
  """The last, short batch of a finite split filled up with all-padding windows."""
  have = len(batch["inputs"])
  if have == rows:
    return batch
  return {k: np.concatenate([v, np.zeros((rows - have,) + v.shape[1:], v.dtype)])
          for k, v in batch.items()}


def train_documents(prepared: Sequence[Prepared], weights: Sequence[float], seed: int,
                    reader: int, readers: int) -> grain.MapDataset:
  """This reader's endless training documents: each source's shuffled per epoch and
  repeated, then, for a mixture, drawn by weight with grain's `MapDataset.mix` (a fixed
  interleaving by index: the proportions hold over any stretch and the state stays one
  index, so a resumed run draws exactly what an uninterrupted one would)."""
  parts = []
  for i, p in enumerate(prepared):
    docs = local_documents(p, "train", reader, readers)
    if len(docs) == 0:
      raise ValueError(f"reader {reader} of {readers} has no training documents in "
                       f"{p.directory} ({len(p.shard_paths('train'))} shards); "
                       f"lower data.num_shards or add documents")
    parts.append(docs.shuffle(seed=(seed + i) % 2**32).repeat())
  return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, list(weights))


def local_batches(prepared: Sequence[Prepared], split: str, seq_len: int, rows: int, seed: int,
                  reader: int, readers: int, weights: Sequence[float] = (1.0,)) -> grain.IterDataset:
  """This reader's batches {packing.FIELDS: [rows, seq_len]}: endless for 'train' (a
  mixture when several prepared sets are given), one pass over its documents (the last
  batch padded) for 'validation' (one prepared set)."""
  if split == "train":
    docs = train_documents(prepared, weights, seed, reader, readers)
  else:
    (one,) = prepared
    docs = local_documents(one, split, reader, readers)
  manifest = prepared[0].manifest   # a mixture's sets share the tokenizer (inputs checks)
  examples = docs.map(functools.partial(packing.document_example, eos=manifest["eos_id"],
                                        own_start=manifest.get("own_start", False)))
  windows = packing.pack(examples.to_iter_dataset(READ_OPTIONS), seq_len)
  batches = windows.batch(rows, drop_remainder=split == "train")
  return batches if split == "train" else batches.map(functools.partial(_pad_rows, rows=rows))


def reader_layout(num_shards: int, global_batch: int, rows: tuple[int, int]) -> tuple[int, list[int], int]:
  """(readers R, this process's readers, rows per reader) for the rows [start, stop) it
  holds. When the process's rows do not fall on reader blocks (a process count that does
  not divide gcd(num_shards, global_batch)), each process is one reader of its own rows:
  still disjoint, but then the batches depend on the process count."""
  start, stop = rows
  readers = math.gcd(num_shards, global_batch)
  per = global_batch // readers
  if start % per or stop % per:
    per = stop - start
    readers = global_batch // per
    if num_shards % readers:
      logging.warning(
          "data.num_shards=%d does not give each of the %d readers whole shard files: every "
          "reader opens every file and takes every %d-th record; set data.num_shards to a "
          "multiple of %d (the shard count should follow the readers)", num_shards, readers,
          readers, readers)
  return readers, list(range(start // per, stop // per)), per


def _concat_rows(parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def train_batches(prepared: Sequence[Prepared], weights: Sequence[float], seq_len: int, seed: int,
                  readers: int, mine: list[int], per: int, worker_count: int = 0) -> grain.IterDataset:
  """This process's training rows: its readers' batches side by side (grain zip: one
  checkpointable state). With worker_count > 0 each reader gets ceil(worker_count /
  readers here) worker processes of its own (grain's multiprocessing prefetch)."""
  parts = [local_batches(prepared, "train", seq_len, per, seed, r, readers, weights) for r in mine]
  if worker_count > 0:
    workers = -(-worker_count // len(parts))
    parts = [p.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers)) for p in parts]
  if len(parts) == 1:
    return parts[0]
  return grain.experimental.ZipIterDataset(parts).map(_concat_rows)


class PaddedReaders(grain.DatasetIterator):
  """This process's validation rows: its readers' batches side by side, a reader that has
  run out giving all-padding rows, until every one has run out (then StopIteration)."""

  def __init__(self, prepared: Prepared, seq_len: int, readers: int, mine: list[int], per: int):
    self._parts = [iter(local_batches([prepared], "validation", seq_len, per, 0, r, readers))
                   for r in mine]
    self._pad = {k: np.stack([v] * per) for k, v in packing.padding_window(seq_len).items()}
    super().__init__(self._parts)

  def __next__(self) -> dict[str, np.ndarray]:
    got = [next(p, None) for p in self._parts]
    if all(g is None for g in got):
      raise StopIteration
    return _concat_rows([self._pad if g is None else g for g in got])

  def get_state(self):
    return {"readers": [p.get_state() for p in self._parts]}

  def set_state(self, state):
    for p, s in zip(self._parts, state["readers"]):
      p.set_state(s)
