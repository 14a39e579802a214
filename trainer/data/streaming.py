"""Per-host streaming of prepared documents: each reader opens only its share of the shards.

A "reader" is one distinct slice of the global batch (usually one process; processes that
hold the same rows, e.g. a batch replicated over hosts, are the same reader). Reader r of
R reads

    the shard files r, r+R, r+2R, ...   when R divides the shard count (only those are opened)
    records r, r+R, ... of all shards    otherwise (still disjoint, every file opened)

and nothing else, so its memory is the ArrayRecord readers plus grain's buffers, whatever
the size of the dataset. Training shuffles its documents per epoch (grain folds the epoch
into the seed) and repeats; validation reads them once in order. Documents are then packed
(packing.py) into windows and batched to the reader's rows. All of it is one grain
IterDataset whose state (a record index plus the packer's buffer position) is what a
checkpoint saves: a resumed run reads exactly what an uninterrupted one would.
"""

from __future__ import annotations

import functools

import grain
import numpy as np

from shardax.trainer.data import packing
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
  ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
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


def local_batches(prepared: Prepared, split: str, seq_len: int, rows: int, seed: int,
                  reader: int, readers: int) -> grain.IterDataset:
  """This reader's batches {packing.FIELDS: [rows, seq_len]}: endless for 'train', one
  pass over its documents (the last batch padded) for 'validation'."""
  docs = local_documents(prepared, split, reader, readers)
  if split == "train":
    if len(docs) == 0:
      raise ValueError(f"reader {reader} of {readers} has no training documents in "
                       f"{prepared.directory} ({len(prepared.shard_paths(split))} shards); "
                       f"lower data.num_shards or add documents")
    docs = docs.shuffle(seed=seed % 2**32).repeat()
  examples = docs.map(functools.partial(packing.document_example, eos=prepared.manifest["eos_id"]))
  windows = packing.pack(examples.to_iter_dataset(READ_OPTIONS), seq_len)
  batches = windows.batch(rows, drop_remainder=split == "train")
  return batches if split == "train" else batches.map(functools.partial(_pad_rows, rows=rows))
