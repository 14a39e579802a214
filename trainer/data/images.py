"""Image and volume data, no downloads: generated 3D shapes and scikit-learn's digits.

  "shapes3d"  volumes [D, H, W, 1] of 1-3 balls and boxes over noise, per-voxel labels
              [D, H, W] (0 background, 1 ball, 2 box). Example i of a split is a pure
              function of (data.seed, split, i): any process count, no files, and the
              validation split draws from a different seed stream than train.
  "digits"    scikit-learn's bundled 1,797 handwritten digits (8x8, 0..16), scaled to
              [0, 1] and upsampled by pixel repetition to data.image_size (default
              16x16); labels 0-9. A fixed permutation (independent of data.seed) puts
              data.validation_fraction of them in validation.

Both are grain random-access sources with a stable `__repr__`, fed through the same
pipeline as text (train: shuffle(seed) + repeat; validation: in order, once; this
process's rows of each global batch; batch), so `inputs.Batches` yields them with the
same one-integer iterator state and exact resume. Batches are {'images', 'labels'}.
"""

from __future__ import annotations

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardax.configs.data import IMAGE_SOURCES, DataConfig, spatial_shape
from shardax.trainer.data import rows as rows_lib

SOURCES = tuple(IMAGE_SOURCES)   # each one's sizes, classes and channels: configs/data.py
SHAPES3D_EXAMPLES = {"train": 1 << 20, "validation": 512}
SPLITS = ("train", "validation")


class Shapes3D:
  """Volumes of balls (label 1) and boxes (label 2) at random places, sizes and brightness
  over Gaussian noise; a later object paints over an earlier one."""

  def __init__(self, seed: int, split: str, shape: tuple[int, ...], noise: float = 0.2):
    self._key, self._shape, self._noise = (seed, SPLITS.index(split)), tuple(shape), noise
    self._len = SHAPES3D_EXAMPLES[split]
    self._grid = np.stack(np.meshgrid(*(np.arange(s, dtype=np.float32) + 0.5 for s in shape),
                                      indexing="ij"), axis=-1)  # [D, H, W, 3] voxel centres

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((*self._key, int(i) % self._len))
    size = np.array(self._shape, np.float32)
    labels = np.zeros(self._shape, np.int32)
    brightness = np.zeros(self._shape, np.float32)
    for _ in range(int(rng.integers(1, 4))):
      kind = int(rng.integers(1, 3))
      radius = max(1.5, float(rng.uniform(0.15, 0.3)) * float(size.min()))
      centre = rng.uniform(np.minimum(radius, size / 2), np.maximum(size - radius, size / 2))
      d = self._grid - centre
      inside = ((d ** 2).sum(-1) <= radius ** 2) if kind == 1 else (np.abs(d).max(-1) <= 0.8 * radius)
      labels[inside] = kind
      brightness[inside] = rng.uniform(0.5, 1.0)
    image = brightness + rng.normal(0.0, self._noise, self._shape).astype(np.float32)
    return {"images": image[..., None].astype(np.float32), "labels": labels}

  def __repr__(self) -> str:
    return f"Shapes3D(key={self._key}, shape={self._shape}, noise={self._noise})"


class Digits:
  """scikit-learn's 8x8 digits, [0, 1], upsampled by pixel repetition to `shape`."""

  def __init__(self, split: str, shape: tuple[int, int], validation_fraction: float):
    try:
      from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - a dependency of the package
      raise ImportError("data.source='digits' needs scikit-learn: pip install scikit-learn") from e
    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    n_val = max(1, int(round(len(order) * validation_fraction)))
    keep = order[:n_val] if split == "validation" else order[n_val:]
    images = (data.images[keep] / 16.0).astype(np.float32)
    fh, fw = shape[0] // 8, shape[1] // 8
    self._images = np.repeat(np.repeat(images, fh, axis=1), fw, axis=2)[..., None]
    self._labels = data.target[keep].astype(np.int32)
    self._repr = f"Digits({split}, n={len(keep)}, shape={tuple(shape)})"

  def __len__(self) -> int:
    return len(self._labels)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return {"images": self._images[int(i)], "labels": self._labels[int(i)]}

  def __repr__(self) -> str:
    return self._repr


def source(cfg: DataConfig, split: str):
  """The random-access source of one split."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: use one of {SPLITS}")
  shape = spatial_shape(cfg)
  if cfg.source == "shapes3d":
    return Shapes3D(cfg.seed, split, shape)
  return Digits(split, shape, cfg.validation_fraction)


def _batch_rows_only(sharding):
  """The sharding of the batch dim alone: all `process_rows` needs to pick this process's rows."""
  if isinstance(sharding, NamedSharding) and len(sharding.spec):
    return NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0]))
  return sharding


def local_dataset(cfg: DataConfig, split: str, global_batch: int, seed: int,
                  sharding: jax.sharding.Sharding | None = None,
                  process_index: int | None = None, process_count: int | None = None):
  """(this process's batches as a MapDataset, examples in the split, its rows [start, stop))."""
  src = source(cfg, split)
  rows = rows_lib.process_rows(global_batch, 1, _batch_rows_only(sharding), process_index, process_count)
  ds = grain.MapDataset.source(src)
  if split == "train":
    ds = ds.shuffle(seed=seed % 2**32).repeat()
  elif len(ds) < global_batch:
    raise ValueError(f"the {split} split of {cfg.source!r} has {len(ds)} examples, fewer than one "
                     f"global batch of {global_batch}; lower train.global_batch")
  ds = rows_lib.ProcessRows(ds, global_batch, *rows)
  return ds.batch(rows[1] - rows[0], drop_remainder=True), len(src), rows
