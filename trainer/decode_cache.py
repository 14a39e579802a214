"""The decode cache: what decoding keeps of the tokens seen so far, laid out on the mesh.

The model describes the cache: `model.cache_spec(batch, length, bounded)` is a pytree of
`CacheSpec` leaves (layers/attention.py: shape, dtype and logical axes of each array),
`length` slots on full-attention layers and a ring of window or chunk slots on windowed and
chunked ones; `bounded=False` gives `length` slots on every layer (no ring: the reference a
ring decode is checked against). Its logical axes go through the experiment's rules like the
params' (batch over data, kv heads over model): `CacheLayout` turns the spec into shardings,
the row count a batch must be a multiple of, and the sharded empty cache a prefill fills.

A prefill writes each row's prompt at positions 0.. and -1 on its padding
(`prefill_positions`), so a ring never keeps a padding slot (layers/attention.py
`write_ring`). The byte counts and `cache_summary` size a cache from its spec alone, without
allocating it (explain, dry runs, benchmarks/decode.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardax import models
from shardax.layers.attention import CacheSpec, default_positions
from shardax.sharding import rules as rules_lib
from shardax.sharding import shard


def _is_spec(x) -> bool:
  return isinstance(x, CacheSpec)


def decode_config(model_cfg):
  """The model config decoding builds, whose cache this is: `for_decode()` where the config
  has one (MoE: every dispatch at its no-overflow bound, no token dropped), else as given."""
  return model_cfg.for_decode() if hasattr(model_cfg, "for_decode") else model_cfg


def prefill_positions(shape: tuple[int, int], lengths: jax.Array) -> jax.Array:
  """int32 [rows, P]: 0..P-1, and -1 past each row's `lengths` (padding: a ring cache never
  keeps it; layers/attention.py `write_ring`)."""
  positions = default_positions(*shape)
  return jnp.where(positions < lengths[:, None], positions, -1)


class CacheLayout:
  """One model's decode cache on one mesh: shapes, shardings, row multiple, the empty cache.

  `model`: a built or abstract model with `cache_spec`; `mesh` and `rules`: where the cache
  lives (None: one device, no shardings, any row count); `allow_uneven`: let a mesh axis
  split a dim it does not divide (else the rules raise, naming the array); `bounded=False`:
  every layer caches all positions (no ring).
  """

  def __init__(self, model, mesh=None, rules: rules_lib.Rules | None = None, allow_uneven: bool = False,
               bounded: bool = True):
    self.model, self.mesh, self.rules = model, mesh, rules
    self.allow_uneven, self.bounded = allow_uneven, bounded

  def spec(self, batch: int, length: int):
    """Tree of `CacheSpec` for `batch` rows and `length` slots."""
    return self.model.cache_spec(batch, length, self.bounded)

  def partition(self, logical, shape, name: str) -> PartitionSpec:
    """The rules' PartitionSpec of a decode array (`name` in errors) of `shape` with `logical`
    axes: the cache's arrays and the prompt batch alike. Needs a mesh and rules."""
    return rules_lib.logical_to_spec(logical, self.rules, dict(self.mesh.shape), shape,
                                     name=name, allow_uneven=self.allow_uneven)

  def shardings(self, batch: int, length: int):
    """NamedSharding of each cache array, from the rules (None without a mesh)."""
    if self.mesh is None or self.rules is None:
      return None
    return jax.tree.map(lambda c: NamedSharding(self.mesh, self.partition(c.axes, c.shape, "KV cache")),
                        self.spec(batch, length), is_leaf=_is_spec)

  def row_multiple(self) -> int:
    """Rows must split evenly over the batch's mesh axes: the data-parallel degree."""
    if self.mesh is None or self.rules is None:
      return 1
    axes = self.partition(("cache_batch",), None, "KV cache")[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([self.mesh.shape[a] for a in axes]))

  def zeros(self, batch: int, length: int):
    """The empty cache, to be called inside a jitted function: zeros of each array, sharded as
    the rules in force say."""
    return jax.tree.map(lambda c: shard(jnp.zeros(c.shape, c.dtype), c.axes), self.spec(batch, length),
                        is_leaf=_is_spec)


def cache_bytes(spec) -> int:
  """Total bytes of a cache described by a tree of `CacheSpec`."""
  leaves = jax.tree.leaves(spec, is_leaf=_is_spec)
  return sum(int(np.prod(c.shape)) * jnp.dtype(c.dtype).itemsize for c in leaves)


def cache_bytes_per_device(spec, shardings) -> int:
  """Bytes of the cache on one device: each array's shard shape under its sharding."""
  leaves = jax.tree.leaves(spec, is_leaf=_is_spec)
  return sum(int(np.prod(sh.shard_shape(c.shape))) * jnp.dtype(c.dtype).itemsize
             for c, sh in zip(leaves, jax.tree.leaves(shardings), strict=True))


def cache_bytes_per_sequence(model, length: int) -> tuple[int, int]:
  """(bytes of one sequence's decode cache for `length` positions as decoding builds it, the
  same with `length` slots on every layer): the two differ where windowed or chunked layers
  keep a ring (layers/attention.py). `model`: a built (or abstract) model with `cache_spec`."""
  return (cache_bytes(model.cache_spec(1, length)), cache_bytes(model.cache_spec(1, length, bounded=False)))


def cache_summary(exp, mesh, rules) -> str | None:
  """One line for explain / dry-run reports: the decode cache for train.global_batch rows
  of model.max_len slots, its split and bytes per device, and the bytes per sequence against
  a full-length cache on every layer (None for models without one)."""
  cfg = decode_config(exp.model)
  model = nnx.eval_shape(lambda: models.build(cfg, nnx.Rngs(0)))
  if not hasattr(model, "cache_spec"):
    return None
  rows, length = exp.train.global_batch, cfg.max_len
  layout = CacheLayout(model, mesh, rules, exp.sharding.allow_uneven)
  spec, shardings = layout.spec(rows, length), layout.shardings(rows, length)
  ring, full = cache_bytes_per_sequence(model, length)
  specs = sorted({str(s.spec) for s in jax.tree.leaves(shardings)})
  return (f"decode KV cache ({rows} rows x {length} slots): {cache_bytes(spec):,} bytes, "
          f"{cache_bytes_per_device(spec, shardings):,} per device, split {', '.join(specs)}; "
          f"per sequence {ring:,} bytes ({full:,} with {length} slots on every layer)")
