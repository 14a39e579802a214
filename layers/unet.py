"""A 3D U-Net for per-voxel segmentation: the GSPMD paper's spatial-partitioning example.

    level 0  ConvBlock(in -> c)        ---------------- skip ----------------> concat -> ConvBlock(2c -> c) -> 1^3 conv -> logits
      down   Conv k2 s2 (c -> 2c)                                              up  ConvTranspose (2c -> c)
    level 1  ConvBlock(2c -> 2c)       ------- skip -------> concat -> ConvBlock(4c -> 2c)
      down   Conv k2 s2 (2c -> 4c)                         up  ConvTranspose (4c -> 2c)
    bottom   ConvBlock(4c -> 4c)

Every activation is (batch, depth, height, width, channels); the experiment's rules
decide which of those dims are split, and the partitioner adds halo exchanges for the
3^3 convs, all-reduces for the norms, and padding for sizes a mesh axis does not divide.
An up-sampled map is cropped to its skip's size, so odd sizes work (9 -> 5 -> 10 -> 9).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax.layers.conv import Conv, ConvBlock, ConvTranspose, activation_axes
from shardax.sharding import shard


class UNet3D(nnx.Module):
  """cfg: a configs.vision.UNet3DConfig; `in_channels` comes from the data source."""

  def __init__(self, cfg: Any, in_channels: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    kw = dict(spatial_dims=3, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
    widths = [cfg.channels * 2 ** i for i in range(cfg.levels + 1)]
    self.encoders = nnx.List()
    self.downs = nnx.List()
    self.ups = nnx.List()
    self.decoders = nnx.List()
    prev = in_channels
    for i, w in enumerate(widths):
      self.encoders.append(ConvBlock(prev, w, groups=cfg.groups, rngs=rngs, **kw))
      if i < cfg.levels:
        self.downs.append(Conv(w, widths[i + 1], kernel=2, stride=2, rngs=rngs, **kw))
      prev = widths[i + 1] if i < cfg.levels else w
    for i in reversed(range(cfg.levels)):
      self.ups.append(ConvTranspose(widths[i + 1], widths[i], rngs=rngs, **kw))
      self.decoders.append(ConvBlock(2 * widths[i], widths[i], groups=cfg.groups, rngs=rngs, **kw))
    self.head = Conv(widths[0], cfg.num_classes, kernel=1, rngs=rngs, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, D, H, W, C_in] -> logits [B, D, H, W, num_classes] (float32)."""
    x = shard(x.astype(self.encoders[0].conv1.dtype), activation_axes(3))
    skips = []
    for i, enc in enumerate(self.encoders):
      x = enc(x)
      if i < len(self.downs):
        skips.append(x)
        x = self.downs[i](x)
    for up, dec in zip(self.ups, self.decoders):
      skip = skips.pop()
      x = up(x)[:, :skip.shape[1], :skip.shape[2], :skip.shape[3]]
      x = dec(jnp.concatenate([x, skip], axis=-1))
    return self.head(x).astype(jnp.float32)

  def loss_and_metrics(self, batch: dict) -> tuple[jax.Array, dict]:
    """Mean per-voxel cross-entropy; voxel accuracy and foreground accuracy as metrics."""
    logits = self(batch["images"])
    labels = batch["labels"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    hit = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    fg = (labels > 0).astype(jnp.float32)
    return loss, {"accuracy": hit.mean(),
                  "foreground_accuracy": (hit * fg).sum() / jnp.maximum(fg.sum(), 1.0)}
