"""Which readers a process runs, and which of their rows it keeps.

The training stream is a function of the config alone: R = gcd(data.num_shards,
global_batch) readers, reader r filling rows [r*B/R, (r+1)*B/R) of every global batch
from its own shard files. R does not depend on the process count, so neither does any
batch, and a checkpoint's per-reader states mean the same thing to any number of
processes: that is what makes a resume on another process count exact.

A process holds a contiguous block of rows (trainer/data/rows.py). It runs every reader
that overlaps its block and keeps its own rows of theirs. When its block is whole reader
blocks (R a multiple of the number of row blocks) that is exactly its share; otherwise it
also reads rows another process keeps (a read factor above 1: more reading, never other
data), and says so once, with the num_shards that would avoid it. We chose redundant
reading over a per-process reader (what shardax did before) because the latter made the
batches depend on the process count, so a resume on another count could only replay.
"""

from __future__ import annotations

import dataclasses
import math

from absl import logging


@dataclasses.dataclass(frozen=True)
class ReaderLayout:
  """R readers of `per` rows each; this process runs readers `mine` and keeps rows
  [keep[0], keep[1]) of their rows side by side."""
  readers: int
  mine: tuple[int, ...]
  per: int
  keep: tuple[int, int]

  @property
  def read_factor(self) -> float:
    """Rows read per row kept (1.0 when the process's rows are whole reader blocks)."""
    return len(self.mine) * self.per / (self.keep[1] - self.keep[0])

  def workers_per_reader(self, worker_count: int) -> int:
    """grain worker processes per reader for data.worker_count per process. Every
    process of a run gets the same number (each worker packs its own slice of the
    documents, so a reader run by two processes must have the same workers on both)."""
    if worker_count <= 0:
      return 0
    kept = self.keep[1] - self.keep[0]
    return min(worker_count, -(-worker_count * self.per // kept))


def reader_layout(num_shards: int, global_batch: int, rows: tuple[int, int]) -> ReaderLayout:
  """The layout for the rows [start, stop) of every global batch this process holds."""
  start, stop = rows
  readers = math.gcd(num_shards, global_batch)
  per = global_batch // readers
  first, last = start // per, -(-stop // per)
  layout = ReaderLayout(readers, tuple(range(first, last)), per, (start - first * per, stop - first * per))
  if layout.read_factor > 1:
    blocks = global_batch // (stop - start)
    logging.warning(
        "data: this process keeps rows [%d, %d) of each batch, not whole blocks of the %d "
        "readers (gcd(data.num_shards=%d, global batch %d)); it reads %.2fx the rows it keeps "
        "so that the batches do not depend on the process count. Set data.num_shards to a "
        "multiple of %d to read only its own rows", start, stop, readers, num_shards,
        global_batch, layout.read_factor, blocks)
  return layout
