"""Training and eval batches: byte windows -> grain -> global jax arrays.

The pipeline, one concept per step:

  token stream (corpus.py; or synthetic)      one uint8 array per split, docs SEP-joined
  -> windows of seq_len+1 at stride seq_len   every next-token pair appears exactly once
  -> train: grain shuffle(seed) + repeat()    reshuffled per epoch (grain folds the epoch
                                              into the shuffle seed); validation: in order, once
  -> this process's rows of each global batch process p takes rows [p*B/P, (p+1)*B/P)
                                              (with a sharding: the rows its devices hold)
  -> batch(B/P) -> {'inputs', 'targets'}      int32 [B/P, seq_len], targets = inputs shifted
  -> Batches                                  global jax.Arrays [B, seq_len] on a sharding

Everything before `Batches` is a grain `MapDataset` (random access by index), so the
iterator state is one integer per process ({'next_index': k}): a resumed run sees exactly
the batches an uninterrupted one would. `Batches` is itself a grain `DatasetIterator`,
so grain's orbax handler saves it directly:

    ckpt.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state),
        data=grain.checkpoint.CheckpointSave(batches)))
    ckpt.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(batches)))   # sets batches' state in place
"""

from __future__ import annotations

import os
from typing import Any

import grain
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from shardax.configs.schema import IMAGE_SOURCES, DataConfig
from shardax.trainer.data import corpus
from shardax.trainer.data.corpus import (BYTE_VOCAB, SEPARATOR_ID, MissingDatasetError,  # noqa: F401
                                    decode, encode)

SPLITS = ("train", "validation")
SYNTHETIC_WINDOWS = {"train": 1 << 24, "validation": 1 << 14}


class WindowSource:
  """Random access to fixed windows of a token stream: window i = tokens[iL : iL+L+1].

  A grain random-access source (`__len__`, `__getitem__`); windows are views, copied
  only when grain stacks a batch.
  """

  def __init__(self, stream: np.ndarray, seq_len: int, name: str):
    self._stream, self._seq_len = stream, seq_len
    self._repr = f"WindowSource({name}, tokens={len(stream)}, seq_len={seq_len})"

  def __len__(self) -> int:
    return max(0, (len(self._stream) - 1) // self._seq_len)

  def __getitem__(self, i: int) -> np.ndarray:
    start = int(i) * self._seq_len
    return self._stream[start:start + self._seq_len + 1]

  def __repr__(self) -> str:
    return self._repr


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


def split_tokens(cfg: DataConfig, split: str) -> np.ndarray:
  """The whole token stream of a split (uint8), preparing the stdlib corpus if needed."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}")
  return corpus.split_stream(cfg.source, os.path.expanduser(cfg.data_dir), split,
                             cfg.text_key, cfg.validation_fraction)


def window_source(cfg: DataConfig, split: str, vocab_size: int = BYTE_VOCAB):
  if cfg.source == "synthetic":
    return SyntheticSource(cfg.seed, split, cfg.seq_len, vocab_size)
  return WindowSource(split_tokens(cfg, split), cfg.seq_len, f"{cfg.source}:{split}")


def process_rows(global_batch: int, seq_len: int,
                 sharding: jax.sharding.Sharding | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> tuple[int, int]:
  """[start, stop): the rows of every global batch that this process loads.

  Without a sharding: [p*B/P, (p+1)*B/P). With one, the rows its addressable devices hold
  (the same thing on a mesh whose batch axis runs across processes in order; all of
  [0, B) where the batch is replicated across processes), so the local data always fits
  `jax.make_array_from_process_local_data`.
  """
  count = jax.process_count() if process_count is None else process_count
  index = jax.process_index() if process_index is None else process_index
  if global_batch < 1 or global_batch % count:
    raise ValueError(
        f"global batch {global_batch} is not divisible by the process count {count} "
        f"(jax.process_count()); each process loads global_batch/process_count rows, so pick "
        f"train.global_batch as a multiple of {count}")
  if sharding is None or process_index is not None:
    local = global_batch // count
    return index * local, (index + 1) * local
  try:
    slices = sharding.addressable_devices_indices_map((global_batch, seq_len)).values()
  except ValueError as e:
    raise ValueError(f"global batch {global_batch} does not split evenly over {sharding}: "
                     f"{e}") from e
  rows = sorted({r for sl in slices for r in range(*sl[0].indices(global_batch))})
  if rows != list(range(rows[0], rows[-1] + 1)):
    raise ValueError(f"this process's devices hold non-contiguous rows of the batch under "
                     f"{sharding}; order the mesh so the batch axis runs across processes")
  return rows[0], rows[-1] + 1


class _ProcessRows(grain.MapDataset):
  """Element i = row start + (i mod n) of global batch (i div n), n = stop - start.

  So the processes together read each global batch once, in row order, and no process
  reads windows it does not keep.
  """

  def __init__(self, parent: grain.MapDataset, global_batch: int, start: int, stop: int):
    super().__init__(parent)
    self._global, self._start, self._local = global_batch, start, stop - start

  def __len__(self) -> int:
    return (len(self._parent) // self._global) * self._local

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self.slice(i)
    k, j = divmod(int(i), self._local)
    return self._parent[k * self._global + self._start + j]

  def __str__(self) -> str:
    return f"_ProcessRows(global={self._global}, start={self._start}, local={self._local})"


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
  ds = _ProcessRows(ds, global_batch, *rows)
  return ds.batch(rows[1] - rows[0], drop_remainder=True).map(_to_example)


class Batches(grain.DatasetIterator):
  """Iterator of global batches {'inputs', 'targets'}: int32 jax.Arrays [B, seq_len].

  With `sharding`, arrays are global (`jax.make_array_from_process_local_data`), each
  process supplying its rows; without, plain `jnp` arrays of this process's rows.
  Checkpointable: `get_state()`/`set_state()` (JSON-serializable dicts), and being a
  grain `DatasetIterator`, grain's orbax handler saves/restores it as is.
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
    row_sharding = next(iter(sharding.values())) if isinstance(sharding, dict) else sharding
    if cfg.source in IMAGE_SOURCES:  # images and volumes: trainer/data/images.py
      from shardax.trainer.data import images
      ds, num_examples, self.rows = images.local_dataset(
          cfg, split, global_batch, self.seed, row_sharding, process_index, process_count)
    else:
      self.rows = process_rows(global_batch, cfg.seq_len, row_sharding, process_index, process_count)
      source = window_source(cfg, split, vocab_size)
      ds = local_dataset(source, split, global_batch, self.seed, self.rows)
      num_examples = len(source)
    iter_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    if cfg.worker_count > 0:
      if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags; outside
        flags.FLAGS.mark_as_parsed()   # app.run (tests, notebooks) use their defaults
      iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.worker_count))
    self.num_windows = num_examples
    self.grain_iterator = iter(iter_ds)
    super().__init__(self.grain_iterator)

  def __next__(self) -> dict[str, jax.Array]:
    local = next(self.grain_iterator)
    if self.sharding is None:
      return {k: jnp.asarray(v) for k, v in local.items()}
    # One sharding for every field, or a dict of them (fields split differently).
    shard_of = self.sharding.get if isinstance(self.sharding, dict) else lambda _: self.sharding
    return {k: jax.make_array_from_process_local_data(shard_of(k), v, (self.global_batch,) + v.shape[1:])
            for k, v in local.items()}

  def _identity(self) -> dict[str, Any]:
    """What a saved state is only valid for; set_state refuses a mismatch."""
    return {"source": self.cfg.source, "split": self.split, "seed": self.seed,
            "global_batch": self.global_batch, "seq_len": self.cfg.seq_len,
            "validation_fraction": self.cfg.validation_fraction,
            "worker_count": self.cfg.worker_count}  # its grain state has another format

  def get_state(self) -> dict[str, Any]:
    return {**self._identity(), "grain": self.grain_iterator.get_state()}

  def set_state(self, state: dict[str, Any]) -> None:
    for k, v in self._identity().items():
      if k in state and state[k] != v:
        raise ValueError(f"data iterator checkpoint was saved with {k}={state[k]!r} but this "
                         f"run has {k}={v!r}; resume with the same data config")
    self.grain_iterator.set_state(state["grain"])

  def __str__(self) -> str:
    return f"Batches({self.cfg.source}, {self.split}, B={self.global_batch}, seed={self.seed})"


def eval_batches(cfg: DataConfig, global_batch: int, n: int,
                 sharding: jax.sharding.Sharding | None = None,
                 **kwargs) -> list[dict[str, jax.Array]]:
  """The first n validation batches from a fresh iterator: the same batches every eval
  (fewer if the split runs out)."""
  it = Batches(cfg, "validation", global_batch, sharding, **kwargs)
  try:
    return [batch for _, batch in zip(range(n), it)]
  finally:
    it.close()


def split_token_count(cfg: DataConfig, split: str) -> int:
  """Tokens in a split's stream (documents plus one separator each); for logs."""
  if cfg.source == "synthetic":
    return SYNTHETIC_WINDOWS[split] * cfg.seq_len
  return int(split_tokens(cfg, split).size)


__all__ = ["Batches", "eval_batches", "encode", "decode", "split_tokens", "split_token_count",
           "window_source", "local_dataset", "process_rows", "WindowSource", "SyntheticSource",
           "MissingDatasetError", "SEPARATOR_ID", "BYTE_VOCAB"]
