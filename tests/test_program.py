"""perf/program.py: the structure of a compiled step (fusions by kind, dots, collectives)."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.perf import program
from shardax.sharding import MeshConfig, make_mesh


def test_a_sharded_matmul_counts_its_dot_fusions_and_all_reduce():
  mesh = make_mesh(MeshConfig(ici=(2, 4)))
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
  w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
  f = lambda a, b: jnp.tanh(a @ b) * 2
  text = jax.jit(f, out_shardings=NamedSharding(mesh, P("data", None))).lower(x, w).compile().as_text()
  s = program.summary(text)
  assert s["dots"] == text.count(" dot(") + text.count(" convolution(") >= 1
  assert sum(s["fusions"].values()) == text.count(" fusion(") >= 1 and all(k.startswith("k") for k in s["fusions"])
  assert s["collectives"]["all-reduce"] == {"count": 1, "async": 0, "bytes": 4 * 32 * 4}
  assert program.format_summary(s).startswith(f"fusions {sum(s['fusions'].values())} (")
