"""Convolutions over NHWC / NDHWC images, written for spatial partitioning.

Nothing here knows about devices. Every activation is annotated with logical names,
`(batch, [depth,] height, width, channels)`, and kernels carry
`(None, ..., None, channels_in, channels)`: the window dims are never split. When an
experiment's rules map `height` (and/or `width`, `depth`) to a mesh axis, the XLA SPMD
partitioner splits each convolution by rows and inserts the halo exchange itself: each
device sends its k//2 border rows to its neighbours (a collective-permute) before its
local convolution. No layer names a mesh axis or calls a collective.

Normalization must not depend on how the image is split, so there is no batch norm
(per-device statistics would change with the mesh, and running averages would be
state the trainer does not carry). `GroupNorm` takes its statistics per example over
all spatial positions and the channels of a group with plain `jnp.mean` over the full
logical dims; when those dims are split, the partitioner adds the all-reduce (and, for
uneven splits, masks the padding). groups=1 is layer norm over (spatial, channels).

Sampling: `Conv(kernel=2, stride=2)` halves every spatial dim and `ConvTranspose`
(kernel 2, stride 2) doubles it. With kernel == stride the windows never straddle a
shard boundary, so neither needs a halo when the shard size is even.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.layers.linear import fan_in_init
from shardax.sharding import manual, shard
from shardax.sharding.annotate import current_mesh_shape

SPATIAL_AXES = {2: ("height", "width"), 3: ("depth", "height", "width")}


def activation_axes(spatial_dims: int) -> tuple[str, ...]:
  """Logical names of an NHWC (2) or NDHWC (3) activation."""
  if spatial_dims not in SPATIAL_AXES:
    raise ValueError(f"spatial_dims={spatial_dims}: use 2 (NHWC images) or 3 (NDHWC volumes)")
  return ("batch",) + SPATIAL_AXES[spatial_dims] + ("channels",)


def _dimension_numbers(n: int) -> tuple[str, str, str]:
  sp = "DHW"[3 - n:]
  return (f"N{sp}C", f"{sp}IO", f"N{sp}C")


def _check_input(x: jax.Array, n: int, channels: int, who: str) -> None:
  if x.ndim != n + 2 or x.shape[-1] != channels:
    layout = "NDHWC" if n == 3 else "NHWC"
    raise ValueError(f"{who} expects a {layout} input with {channels} channels, got shape {x.shape}")


class MiscompiledPartitionError(ValueError):
  """A spatial split that XLA's SPMD partitioner (jaxlib 0.10.2) gets wrong; see docs/spatial.md."""


def check_partitioning(shape: tuple[int, ...], axes: tuple[str, ...], halo: bool) -> None:
  """Refuse the two spatial splits that XLA partitions into wrong gradients (silently).

  Found by comparing against one device (docs/spatial.md has the minimal repro):
  1. a spatial dim is split while the activation is replicated over another mesh axis of
     size > 1: the kernel gradient comes out multiplied by that replication factor;
  2. two or more spatial dims are split and a shard of one holds a single row/column
     (convs with a halo): the input gradient is wrong.
  No mesh or no rules: nothing to check (the split is `manual.layout`'s; no mesh axis is named here).
  """
  layout = manual.layout(axes)
  used = {a for cut in layout.axes for a in cut}
  split = {axes[i]: e for i, e in enumerate(layout.spec) if e and axes[i] not in ("batch", "channels")}
  if not split:
    return
  idle = sorted(a for a, n in current_mesh_shape().items() if n > 1 and a not in used)
  if idle:
    raise MiscompiledPartitionError(
        f"conv activation {axes} of shape {shape} splits {split} but is replicated over mesh "
        f"axes {idle}; XLA would scale the kernel gradients by their size. Map every mesh axis of "
        f"size > 1 to a dim of the activation in the sharding rules (e.g. add it to the "
        f"batch rule) or shrink it to 1")
  if halo and len(split) > 1:
    for i in range(len(axes)):
      parts = layout.parts(i)
      if axes[i] in split and -(-shape[i] // parts) < 2:
        raise MiscompiledPartitionError(
            f"conv activation {axes} of shape {shape}: dim {axes[i]!r} split {parts} ways leaves "
            f"one row per shard while {len(split)} spatial dims are split; XLA computes wrong input "
            f"gradients for that. Split fewer spatial dims, use fewer down samplings "
            f"(model.levels) or a larger image")


class Conv(nnx.Module):
  """y = conv(x, kernel) + bias, SAME padding (a stride-s conv gives ceil(size/s))."""

  def __init__(self, in_channels: int, out_channels: int, *, spatial_dims: int, kernel: int = 3,
               stride: int = 1, use_bias: bool = True, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.n, self.stride, self.in_channels, self.dtype = spatial_dims, stride, in_channels, dtype
    self.axes = activation_axes(spatial_dims)
    shape = (kernel,) * spatial_dims + (in_channels, out_channels)
    self.kernel = nnx.Param(fan_in_init(spatial_dims + 1)(rngs.params(), shape, param_dtype),
                            logical_axes=(None,) * spatial_dims + ("channels_in", "channels"))
    self.bias = (nnx.Param(jnp.zeros((out_channels,), param_dtype), logical_axes=("channels",))
                 if use_bias else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    _check_input(x, self.n, self.in_channels, "Conv")
    check_partitioning(x.shape, self.axes, halo=self.kernel.shape[0] > self.stride)
    y = jax.lax.conv_general_dilated(
        x.astype(self.dtype), self.kernel[...].astype(self.dtype),
        window_strides=(self.stride,) * self.n, padding="SAME",
        dimension_numbers=_dimension_numbers(self.n))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return shard(y, self.axes)


class ConvTranspose(nnx.Module):
  """Up sampling by `stride`: each input voxel paints a stride^n block (kernel == stride)."""

  def __init__(self, in_channels: int, out_channels: int, *, spatial_dims: int, stride: int = 2,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.n, self.stride, self.in_channels, self.dtype = spatial_dims, stride, in_channels, dtype
    self.axes = activation_axes(spatial_dims)
    shape = (stride,) * spatial_dims + (in_channels, out_channels)
    # Each output voxel sees one input voxel through one kernel tap: fan-in = in_channels.
    self.kernel = nnx.Param(fan_in_init(spatial_dims + 1, scale=stride ** spatial_dims)(
        rngs.params(), shape, param_dtype),
        logical_axes=(None,) * spatial_dims + ("channels_in", "channels"))
    self.bias = nnx.Param(jnp.zeros((out_channels,), param_dtype), logical_axes=("channels",))

  def __call__(self, x: jax.Array) -> jax.Array:
    _check_input(x, self.n, self.in_channels, "ConvTranspose")
    check_partitioning(x.shape, self.axes, halo=False)
    y = jax.lax.conv_transpose(
        x.astype(self.dtype), self.kernel[...].astype(self.dtype), (self.stride,) * self.n,
        padding="VALID", dimension_numbers=_dimension_numbers(self.n))
    return shard(y + self.bias[...].astype(self.dtype), self.axes)


class GroupNorm(nnx.Module):
  """Per example: normalize over all spatial positions x the channels of each group.

  Statistics are float32 `jnp.mean`s over the whole logical dims, so the result does
  not depend on how batch or spatial dims are split over devices.
  """

  def __init__(self, channels: int, *, groups: int = 1, eps: float = 1e-5, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init
    if groups < 1 or channels % groups:
      raise ValueError(f"GroupNorm: groups={groups} must divide channels={channels}")
    self.groups, self.eps, self.dtype = groups, eps, dtype
    self.scale = nnx.Param(jnp.ones((channels,), param_dtype), logical_axes=("channels",))
    self.bias = nnx.Param(jnp.zeros((channels,), param_dtype), logical_axes=("channels",))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    grouped = x32.reshape(x.shape[:-1] + (self.groups, x.shape[-1] // self.groups))
    axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)  # spatial dims and channels-in-group
    mean = jnp.mean(grouped, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(grouped - mean), axis=axes, keepdims=True)
    y = ((grouped - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


class ConvBlock(nnx.Module):
  """Two (3^n conv -> group norm -> relu) layers: the unit of U-Net levels and the classifier."""

  def __init__(self, in_channels: int, out_channels: int, *, spatial_dims: int, groups: int,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    groups = math.gcd(groups, out_channels)
    self.conv1 = Conv(in_channels, out_channels, spatial_dims=spatial_dims, rngs=rngs, **kw)
    self.norm1 = GroupNorm(out_channels, groups=groups, **kw)
    self.conv2 = Conv(out_channels, out_channels, spatial_dims=spatial_dims, rngs=rngs, **kw)
    self.norm2 = GroupNorm(out_channels, groups=groups, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.norm1(self.conv1(x)))
    return jax.nn.relu(self.norm2(self.conv2(x)))
