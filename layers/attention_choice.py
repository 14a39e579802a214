"""Which attention implementation runs here: the one decision every attention path
(layers/attention.py, layers/context_parallel.py) asks, kept below both so neither
imports the other for it."""

from __future__ import annotations

import jax

from shardax.configs.attention import AttentionOptions
from shardax.layers import flash


def target_platform() -> str:
  """The platform the step is being compiled for: the current mesh's devices (a TPU
  topology in a dry run says 'tpu' on this CPU), else jax's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return getattr(device, "platform", None) or jax.default_backend()


def resolve(options: AttentionOptions, q_len: int, kv_len: int) -> str:
  """The implementation `options` asks for here ('auto' decided by target_platform)."""
  if options.implementation != "auto":
    return options.implementation
  platform = target_platform()
  if platform == "tpu" and flash.supports(q_len, kv_len):
    return "flash"
  return "fused" if platform == "gpu" and options.softcap is None else "xla"
