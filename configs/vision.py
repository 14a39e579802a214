"""Model configs for images and volumes: a 3D U-Net and a small 2D classifier.

They plug into the trainer through the same seam as `TransformerConfig`:
`batch_fields(data)`, `tokens_per_example(data)` (= voxels or pixels, so "tokens/s" reads
as voxels/s) and `flops_per_example(data)`; their modules are built through their model
families (models/vision.py), so these configs stay data.

FLOPs are counted from the convolutions alone: one conv does
outputs x kernel_volume x C_in x C_out multiply-accumulates (MACs), 2 FLOPs each, and
training costs 3x the forward pass (backward = grads w.r.t. inputs + weights, each as
much as the forward). So flops_per_example = 2 x MACs x 3. A transposed conv with
kernel == stride counts its (uncropped) outputs x C_in x C_out. Norms, activations and
the loss are elementwise and left out (a few % at these widths).

Batch fields are split on `batch` only. Spatial partitioning is for activations: the
model's first `shard()` slices the input locally (no communication), and jit
arguments, unlike intermediate values, cannot be split unevenly, so an uneven
height split (`sharding.allow_uneven=True`) still trains.
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs.data import IMAGE_SOURCES, DataConfig, spatial_shape
from shardax.configs.errors import ConfigError
from shardax.configs.errors import require as _require

TRAIN_FLOPS_PER_FORWARD_MAC = 2 * 3  # 2 FLOPs per MAC, forward + backward = 3 x forward


def conv_macs(out_spatial: tuple[int, ...], kernel: int, in_channels: int, out_channels: int) -> int:
  """Multiply-accumulates of one conv for one example: outputs x window x C_in x C_out."""
  return math.prod(out_spatial) * kernel ** len(out_spatial) * in_channels * out_channels


def downsampled(spatial: tuple[int, ...], stride: int = 2) -> tuple[int, ...]:
  """Spatial shape after a SAME stride-`stride` conv (layers/conv.py): ceil(size / stride)."""
  return tuple(-(-s // stride) for s in spatial)


def _image_fields(data: DataConfig, rank: int, in_channels: int, num_classes: int,
                  per_pixel_labels: bool, who: str) -> dict:
  if data.source not in IMAGE_SOURCES or len(spatial_shape(data)) != rank:
    ok = [s for s, src in IMAGE_SOURCES.items() if len(src.default_size) == rank]
    raise ConfigError(f"data.source={data.source!r}: {who} needs {rank}D images; use one of {ok}")
  src = IMAGE_SOURCES[data.source]
  _require(src.num_classes == num_classes,
           f"model.num_classes={num_classes} but data.source={data.source!r} has "
           f"{src.num_classes} classes; set model.num_classes to match")
  _require(src.in_channels == in_channels,
           f"model.in_channels={in_channels} but data.source={data.source!r} has "
           f"{src.in_channels} channels; set model.in_channels to match")
  shape = spatial_shape(data)
  rest = (None,) * rank
  labels = (shape, "int32", ("batch",) + rest) if per_pixel_labels else ((), "int32", ("batch",))
  return {"images": (shape + (in_channels,), "float32", ("batch",) + rest + (None,)),
          "labels": labels}


@dataclasses.dataclass(frozen=True)
class _VisionConfig:
  channels: int = 8                   # width of the first level; doubles at each down sampling
  levels: int = 2                     # down samplings (each: stride-2 conv)
  groups: int = 4                     # group-norm groups (1 = layer norm over spatial x channels)
  num_classes: int = 3
  in_channels: int = 1
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    for f in ("channels", "levels", "groups", "num_classes", "in_channels"):
      _require(getattr(self, f) >= (0 if f == "levels" else 1), f"model.{f}={getattr(self, f)} is too small")
    _require(self.channels % self.groups == 0,
             f"model.groups={self.groups} must divide model.channels={self.channels}")
    for f in ("dtype", "param_dtype"):
      _require(getattr(self, f) in ("float32", "bfloat16"),
               f"model.{f}={getattr(self, f)!r}: use 'float32' or 'bfloat16'")

  def _spatial(self, data: DataConfig) -> tuple[int, ...]:
    return spatial_shape(data)

  def tokens_per_example(self, data: DataConfig) -> int:
    """Pixels or voxels per example."""
    return math.prod(self._spatial(data))

  def flops_per_example(self, data: DataConfig) -> float:
    """Training FLOPs of one example: 2 x conv MACs x 3 (see the module docstring)."""
    return float(TRAIN_FLOPS_PER_FORWARD_MAC * self.forward_macs(data))


@dataclasses.dataclass(frozen=True)
class UNet3DConfig(_VisionConfig):
  """3D U-Net for per-voxel segmentation (layers/unet.py)."""

  def batch_fields(self, data: DataConfig) -> dict:
    fields = _image_fields(data, 3, self.in_channels, self.num_classes, True, "the 3D U-Net")
    _require(min(self._spatial(data)) >= 2 ** self.levels,
             f"data.image_size={self._spatial(data)}: {self.levels} down samplings need every "
             f"size >= {2 ** self.levels}; lower model.levels or raise the size")
    return fields

  def forward_macs(self, data: DataConfig) -> int:
    shapes = [self._spatial(data)]
    for _ in range(self.levels):
      shapes.append(downsampled(shapes[-1]))
    w = [self.channels * 2 ** i for i in range(self.levels + 1)]
    macs = 0
    for i, s in enumerate(shapes):
      macs += conv_macs(s, 3, self.in_channels if i == 0 else w[i], w[i]) + conv_macs(s, 3, w[i], w[i])
      if i < self.levels:
        up = tuple(2 * x for x in shapes[i + 1])
        macs += conv_macs(shapes[i + 1], 2, w[i], w[i + 1])          # down: k2 s2
        macs += conv_macs(up, 1, w[i + 1], w[i])                     # up: each output one tap
        macs += conv_macs(s, 3, 2 * w[i], w[i]) + conv_macs(s, 3, w[i], w[i])  # decoder
    return macs + conv_macs(shapes[0], 1, w[0], self.num_classes)   # head


@dataclasses.dataclass(frozen=True)
class ClassifierConfig(_VisionConfig):
  """Small 2D CNN classifier (layers/classifier.py)."""
  channels: int = 16
  num_classes: int = 10

  def batch_fields(self, data: DataConfig) -> dict:
    return _image_fields(data, 2, self.in_channels, self.num_classes, False, "the classifier")

  def forward_macs(self, data: DataConfig) -> int:
    s, w = self._spatial(data), self.channels
    macs = conv_macs(s, 3, self.in_channels, w) + conv_macs(s, 3, w, w)
    for _ in range(self.levels):
      s = downsampled(s)
      macs += conv_macs(s, 2, w, 2 * w) + 2 * conv_macs(s, 3, 2 * w, 2 * w)
      w *= 2
    return macs + w * self.num_classes
