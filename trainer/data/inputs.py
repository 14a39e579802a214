"""The loader: training and eval batches as global jax arrays, one iterator per split.

Text sources (stdlib, tfds:NAME, files:GLOB):

  preparation.py   tokenized once into sharded ArrayRecord files (+ manifest), reused
  streaming.py     this process's shards -> documents (train: shuffled per epoch, repeated)
  packing.py       -> windows {inputs, targets, segment_ids, positions, loss_mask} of seq_len
  -> batch(rows this process holds) -> Batches: global jax.Arrays [B, seq_len] on a sharding

`synthetic` skips all that: seeded random windows ({inputs, targets}) by index.

The iterator state is grain's plus what it is valid for (a JSON dict), so a resumed run
sees exactly the batches an uninterrupted one would. Every process saves its own state
in the checkpoint's step (trainer/checkpoint.py `data_states`: one file per process, in
the same orbax commit as the weights) and restores its own: nothing is read twice. The
batches are a function of the config alone (R = gcd(num_shards, global_batch) readers,
fixed by the config, not by the process count; layout.py), so on another process count
`set_state` takes every writer's state and rebuilds its readers' positions from theirs
(resume.py): exact in every layout, nothing replayed, or refused with the reason.
Synthetic and image data need only the batch index. `SHARDAX_RECORD_DOCUMENTS=DIR`
records the documents every step took (record.py).

Evaluation (`iter_eval_batches`) reads the whole validation split by default: each process
its own documents, once, in order; a process that runs out first feeds all-padding
batches (loss_mask 0) until every process is done, so all run the same number of steps.
A mixture (data.mixture) trains on its sources drawn by weight (streaming.train_documents)
and is evaluated source by source (trainer/loop.py reports each and the total).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import grain
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from shardax.configs.data import IMAGE_SOURCES, DataConfig
from shardax.trainer import distributed
from shardax.trainer.data import images, packing, preparation, record, resume, streaming
from shardax.trainer.data.layout import reader_layout
from shardax.trainer.data.rows import ProcessRows, process_rows
from shardax.trainer.data.sources import SPLITS, MissingDatasetError  # noqa: F401
from shardax.trainer.data.tokenizers import BYTE_VOCAB, SEPARATOR_ID  # noqa: F401

SYNTHETIC_WINDOWS = {"train": 1 << 24, "validation": 1 << 10}


class SyntheticSource:
  """Seeded random windows with learnable structure: a random motif of 2..16 tokens
  repeated to fill the window, so after one period every target is predictable by
  copying (an induction task); loss falling well below log(vocab) shows learning.

  Window i is a pure function of (seed, split, i): no files, any process count.
  """

  def __init__(self, seed: int, split: str, seq_len: int, vocab_size: int):
    self._key = (seed, SPLITS.index(split))
    self._seq_len, self._vocab = seq_len, vocab_size
    self._len = SYNTHETIC_WINDOWS[split]

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> np.ndarray:
    rng = np.random.default_rng((*self._key, int(i) % self._len))
    motif = rng.integers(1, self._vocab, size=int(rng.integers(2, 17)), dtype=np.int32)
    return np.resize(motif, self._seq_len + 1)

  def __repr__(self) -> str:
    return f"SyntheticSource(key={self._key}, seq_len={self._seq_len}, vocab={self._vocab})"


def _to_example(windows: np.ndarray) -> dict[str, np.ndarray]:
  windows = windows.astype(np.int32)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


def local_dataset(source, split: str, global_batch: int, seed: int,
                  rows: tuple[int, int]) -> grain.MapDataset:
  """This process's batches (rows [start, stop) of each global batch) as a MapDataset."""
  ds = grain.MapDataset.source(source)
  if split == "train":
    ds = ds.shuffle(seed=seed % 2**32).repeat()  # shuffle folds the epoch into its seed
  elif len(ds) < global_batch:
    raise ValueError(f"the {split} split has {len(ds)} windows, fewer than one global batch "
                     f"of {global_batch}; lower the batch or data.seq_len")
  ds = ProcessRows(ds, global_batch, *rows)
  return ds.batch(rows[1] - rows[0], drop_remainder=True).map(_to_example)


def _flags_for_workers(cfg: DataConfig) -> None:
  """grain's worker processes read its absl flags; outside app.run (tests, notebooks)
  mark them parsed so the defaults apply."""
  if cfg.worker_count > 0 and not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


class Batches(grain.DatasetIterator):
  """Iterator of global batches: int32/float32 jax.Arrays [B, seq_len] per field.

  With `sharding` (one, or a dict per field), arrays are global
  (`jax.make_array_from_process_local_data`), each process supplying its rows, and only
  the fields the dict names are kept; without, plain `jnp` arrays of this process's rows.
  Checkpointable: `get_state()`/`set_state()` (JSON-serializable dicts), and being a
  grain `DatasetIterator`, grain's orbax handler saves/restores it as is.
  A finite split (validation) ends with StopIteration.
  """

  def __init__(self, cfg: DataConfig, split: str, global_batch: int,
               sharding: jax.sharding.Sharding | None = None, *, seed: int | None = None,
               vocab_size: int = BYTE_VOCAB, process_index: int | None = None,
               process_count: int | None = None):
    """`seed` defaults to cfg.seed; `vocab_size` bounds synthetic tokens only;
    process_index/process_count override jax's (tests simulate processes; then the
    sharding does not choose the rows)."""
    self._closed, self._parents = True, ()  # a failed __init__ leaves __del__ a no-op
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: use one of {SPLITS}")
    self.cfg, self.split, self.global_batch, self.sharding = cfg, split, global_batch, sharding
    self.seed = cfg.seed if seed is None else seed
    self.prepared, self.readers, self.layout, self.recorder, self.consumed = None, None, None, None, 0
    row_sharding = next(iter(sharding.values())) if isinstance(sharding, dict) else sharding
    if cfg.source in IMAGE_SOURCES:  # images and volumes: trainer/data/images.py
      ds, _, self.rows = images.local_dataset(
          cfg, split, global_batch, self.seed, row_sharding, process_index, process_count)
      iter_ds = ds.to_iter_dataset(streaming.READ_OPTIONS)
    elif cfg.source == "synthetic":
      self.rows = process_rows(global_batch, cfg.seq_len, row_sharding, process_index, process_count)
      source = SyntheticSource(cfg.seed, split, cfg.seq_len, vocab_size)
      ds = local_dataset(source, split, global_batch, self.seed, self.rows)
      iter_ds = ds.to_iter_dataset(streaming.READ_OPTIONS)
    else:
      self.rows = process_rows(global_batch, cfg.seq_len, row_sharding, process_index, process_count)
      if cfg.mixture and split == "validation":
        raise ValueError(f"a mixture is evaluated source by source: read "
                         f"Batches(cfg.for_source(s), 'validation', ...) for each s of "
                         f"{[s for s, _ in cfg.components]} (iter_eval_batches does)")
      sets = preparation.prepare_components(cfg)
      self.prepared = sets[0]
      self.layout = reader_layout(cfg.num_shards, global_batch, self.rows)
      self.readers = list(self.layout.mine)
      if split == "validation":  # finite, no workers: readers padded until all are done
        self.grain_iterator = streaming.PaddedReaders(self.prepared, cfg.seq_len, self.layout)
        super().__init__(self.grain_iterator)
        return
      _flags_for_workers(cfg)
      if (where := record.directory()) is not None:
        self.recorder = record.Recorder(where, jax.process_index() if process_index is None else process_index,
                                        jax.process_count() if process_count is None else process_count,
                                        self.rows)
      iter_ds = streaming.train_batches(sets, [w for _, w in cfg.components], cfg.seq_len, self.seed,
                                        self.layout, worker_count=cfg.worker_count,
                                        with_ids=self.recorder is not None)
    if cfg.worker_count > 0 and self.prepared is None:
      _flags_for_workers(cfg)
      iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    self.grain_iterator = iter(iter_ds)
    super().__init__(self.grain_iterator)

  def __next__(self) -> dict[str, jax.Array]:
    local = next(self.grain_iterator)
    self.consumed += 1
    if self.recorder is not None:
      self.recorder.write(self.consumed, local.pop("document"))
    return self.to_global(local)

  def to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """This process's rows -> the batch the step takes (global arrays with a sharding)."""
    if self.sharding is None:
      return {k: jnp.asarray(v) for k, v in local.items()}
    if isinstance(self.sharding, dict):  # one sharding per field the model takes
      return {k: jax.make_array_from_process_local_data(s, local[k], (self.global_batch,) + local[k].shape[1:])
              for k, s in self.sharding.items()}
    return {k: jax.make_array_from_process_local_data(self.sharding, v, (self.global_batch,) + v.shape[1:])
            for k, v in local.items()}

  def padding(self) -> dict[str, np.ndarray]:
    """This process's rows of an all-padding batch (text sources): no loss, no tokens."""
    w = packing.padding_window(self.cfg.seq_len)
    return {k: np.stack([v] * (self.rows[1] - self.rows[0])) for k, v in w.items()}

  def _identity(self) -> dict[str, Any]:
    """What a saved state is only valid for; set_state refuses a mismatch."""
    return {"source": self.cfg.source, "split": self.split, "seed": self.seed,
            "global_batch": self.global_batch, "seq_len": self.cfg.seq_len,
            "validation_fraction": self.cfg.validation_fraction,
            "tokenizer": self.cfg.tokenizer, "num_shards": self.cfg.num_shards,
            "worker_count": self.cfg.worker_count,  # its grain state has another format
            "mixture": [[src, w] for src, w in self.cfg.mixture]}

  def get_state(self) -> dict[str, Any]:
    state = {**self._identity(), "grain": self.grain_iterator.get_state(), "readers": self.readers,
             "reader_count": self.layout.readers if self.layout else None, "batches": self.consumed}
    if self.layout and self.cfg.worker_count > 0:
      state["workers_per_reader"] = self.layout.workers_per_reader(self.cfg.worker_count)
    return state

  def _check_identity(self, state: dict[str, Any]) -> None:
    for k, v in self._identity().items():
      if k in state and state[k] != v:
        raise ValueError(f"data iterator checkpoint was saved with {k}={state[k]!r} but this "
                         f"run has {k}={v!r}; resume with the same data config")

  def _check_workers(self, state: dict[str, Any]) -> None:
    if not self.layout or self.cfg.worker_count <= 0:
      return
    per = self.layout.workers_per_reader
    resume.check_workers(state.get("workers_per_reader"), per(self.cfg.worker_count), self.cfg.worker_count,
                         lambda w: next((n for n in range(1, 4097) if per(n) == w), None))

  def set_state(self, state: dict[str, Any] | list[dict[str, Any]]) -> int:
    """Resume from this process's saved state, or (a list) from every process's state
    of a run on another process count. Exact or refused (resume.DataResumeError);
    returns the batches replayed: always 0 (the loop logs it)."""
    states = state if isinstance(state, list) else [state]
    for st in states:
      self._check_identity(st)
      self._check_workers(st)
    batches = resume.batch_count(states, self.consumed)
    own = states[0]["grain"] if self.readers is None else \
        resume.reader_states(states, self.readers, self.layout.readers)
    self.grain_iterator.set_state(packing.state_from_json(own))
    self.consumed = batches
    return 0

  def close(self) -> None:
    if self.recorder is not None:
      self.recorder.close()
      self.recorder = None
    super().close()

  def __str__(self) -> str:
    return f"Batches({self.cfg.source}, {self.split}, B={self.global_batch}, seed={self.seed})"


def iter_eval_batches(cfg: DataConfig, global_batch: int, n: int | None = None,
                      sharding: jax.sharding.Sharding | None = None,
                      **kwargs) -> Iterator[dict[str, jax.Array]]:
  """Validation batches from a fresh iterator: the whole split (n=None) or its first n
  batches; the same ones at every call. A process out of data before the others (text
  sources) feeds all-padding batches, so every process takes the same number of steps."""
  if cfg.mixture:   # every source's validation split in turn (the loop reports each)
    for src, _ in cfg.components:
      yield from iter_eval_batches(cfg.for_source(src), global_batch, n, sharding, **kwargs)
    return
  it = Batches(cfg, "validation", global_batch, sharding, **kwargs)
  simulated = kwargs.get("process_index") is not None
  try:
    count = 0
    while n is None or count < n:
      local = next(it.grain_iterator, None)
      here = local is not None   # a simulated process (process_index given) is alone in this one
      if not (here if simulated else distributed.any_process(here)):
        return
      yield it.to_global(it.padding() if local is None else local)
      count += 1
  finally:
    it.close()


def eval_batches(cfg: DataConfig, global_batch: int, n: int | None,
                 sharding: jax.sharding.Sharding | None = None,
                 **kwargs) -> list[dict[str, jax.Array]]:
  """`iter_eval_batches` as a list (for a few batches kept on device, e.g. benchmarks)."""
  return list(iter_eval_batches(cfg, global_batch, n, sharding, **kwargs))


def source_labels(sources: Sequence[str]) -> list[str]:
  """Short, distinct names of a mixture's sources for metric keys: what tells them apart
  (the part after their common prefix, slugged: 'files:/d/web/*.jsonl' and
  'files:/d/code/*.py' -> 'web_jsonl', 'code_py'), numbered if still equal."""
  prefix = os.path.commonprefix(list(sources)) if len(sources) > 1 else ""
  labels = [re.sub(r"[^A-Za-z0-9]+", "_", s[len(prefix):]).strip("_")[-40:] or f"source{k}"
            for k, s in enumerate(sources)]
  if len(set(labels)) < len(labels):
    labels = [f"{k}_{label}" for k, label in enumerate(labels)]
  return labels


def targets_per_byte(cfg: DataConfig, split: str = "validation") -> float | None:
  """Predicted tokens (document tokens + one end-of-document each) per utf-8 byte of a
  text split, from the manifest; loss per token x this / ln 2 = bits per byte, a figure
  that compares models with different tokenizers. None for non-text sources."""
  if cfg.source == "synthetic" or cfg.source in IMAGE_SOURCES:
    return None
  counts = [p.split_counts(split) for p in preparation.prepare_components(cfg)]
  return sum(c["tokens"] + c["documents"] for c in counts) / max(sum(c["bytes"] for c in counts), 1)


__all__ = ["Batches", "eval_batches", "iter_eval_batches", "targets_per_byte", "source_labels", "local_dataset",
           "process_rows", "SyntheticSource", "MissingDatasetError", "SEPARATOR_ID", "BYTE_VOCAB"]
