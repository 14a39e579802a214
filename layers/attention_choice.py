"""Which attention implementation runs here: the one decision every attention path
(layers/attention.py, layers/context_parallel.py) asks, kept below both so neither
imports the other for it."""

from __future__ import annotations

from shardax.configs.attention import AttentionOptions
from shardax.layers import flash
from shardax.sharding.target import target_platform


def resolve(options: AttentionOptions, q_len: int, kv_len: int) -> str:
  """The implementation `options` asks for here ('auto' decided by target_platform)."""
  if options.implementation != "auto":
    return options.implementation
  if options.sinks:   # no kernel takes a sink logit (configs/attention.py AttentionOptions)
    return "xla"
  platform = target_platform()
  if platform == "tpu" and flash.supports(q_len, kv_len):
    return "flash"
  return "fused" if platform == "gpu" and options.softcap is None else "xla"
