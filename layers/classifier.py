"""A small 2D CNN image classifier: conv blocks with strided down sampling, global mean
pool, one linear head.

    ConvBlock(in -> c) -> [Conv k2 s2 (w -> 2w) -> ConvBlock(2w -> 2w)] x levels
      -> mean over (height, width) -> dense -> logits

Activations are (batch, height, width, channels), so the same rules that split a
U-Net's height split this model's too; the global pool is a `jnp.mean` over the full
logical spatial dims (an all-reduce when they are split).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardax.layers.conv import Conv, ConvBlock, activation_axes
from shardax.layers.linear import DenseGeneral
from shardax.sharding import shard


class ImageClassifier(nnx.Module):
  """cfg: a configs.vision.ClassifierConfig; `in_channels` comes from the data source."""

  def __init__(self, cfg: Any, in_channels: int, *, rngs: nnx.Rngs):
    kw = dict(spatial_dims=2, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
    self.dtype = jnp.dtype(cfg.dtype)
    self.stem = ConvBlock(in_channels, cfg.channels, groups=cfg.groups, rngs=rngs, **kw)
    self.downs = nnx.List()
    self.blocks = nnx.List()
    w = cfg.channels
    for _ in range(cfg.levels):
      self.downs.append(Conv(w, 2 * w, kernel=2, stride=2, rngs=rngs, **kw))
      self.blocks.append(ConvBlock(2 * w, 2 * w, groups=cfg.groups, rngs=rngs, **kw))
      w *= 2
    self.head = DenseGeneral(w, cfg.num_classes, in_axes=("channels",), out_axes=("classes",),
                             dtype=self.dtype, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """[B, H, W, C_in] -> logits [B, num_classes] (float32)."""
    x = self.stem(shard(x.astype(self.dtype), activation_axes(2)))
    for down, block in zip(self.downs, self.blocks):
      x = block(down(x))
    pooled = jnp.mean(x.astype(jnp.float32), axis=(1, 2))
    return shard(self.head(pooled, out_dtype=jnp.float32), ("batch", "classes"))

  def loss_and_metrics(self, batch: dict) -> tuple[jax.Array, dict]:
    logits = self(batch["images"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    accuracy = (jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy}
