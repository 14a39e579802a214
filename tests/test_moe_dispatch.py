"""The dropless dispatch's row reorderings (layers/moe_dispatch.py: `permute`).

The dispatch sorts the T x k token copies by expert, and under expert parallelism sorts the
received rows (padding last) again; after the expert matmuls both orders are undone. Each
undo is a permutation of all rows (padding rows included: grouped_ffn gives them 0), written
before as a scatter, `zeros.at[order].set(out)`. `permute` writes it as the gather
out[argsort(order)] with a gather for its backward too. Here: it computes exactly what the
scatter did, forward and backward, on random permutations with and without padding rows;
and in a step compiled by libtpu (no TPU needed) neither the un-sorts nor the sort of the
received rows leave a scatter of rows in the forward or the backward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.layers.moe_dispatch import permute
from shardax.perf import hlo as hlo_lib

M = 24


def sorted_rows(seed: int, rows: int, groups: int, pad: int):
  """(order, inverse, v, ct) as the dispatch meets them: `order` the stable argsort of `rows`
  expert ids in [0, groups), the last `pad` of them (in random places) padding (id groups,
  sorted last); v [rows, M] in expert order, its padding rows 0 (grouped_ffn's output); a
  cotangent ct of the same shape."""
  rng = np.random.default_rng(seed)
  ids = np.concatenate([rng.integers(0, groups, rows - pad), np.full(pad, groups)])
  ids = jnp.asarray(rng.permutation(ids), jnp.int32)
  order = jnp.argsort(ids, stable=True)
  v = jnp.asarray(rng.standard_normal((rows, M)), jnp.float32)
  v = jnp.where((jnp.arange(rows) < rows - pad)[:, None], v, 0)
  return order, jnp.argsort(order), v, jnp.asarray(rng.standard_normal((rows, M)), jnp.float32)


def value_and_grad(f, v, ct):
  y, vjp = jax.vjp(jax.jit(f), v)
  return y, vjp(ct)[0]


@pytest.mark.parametrize("seed, rows, groups, pad", [(0, 64, 8, 0), (1, 256, 2, 100), (2, 40, 5, 7)])
def test_unsort_equals_the_scatter_it_replaces_forward_and_backward(seed, rows, groups, pad):
  order, inverse, v, ct = sorted_rows(seed, rows, groups, pad)
  assert not np.array_equal(order, inverse)           # a permutation that is not its own inverse
  want = value_and_grad(lambda v: jnp.zeros_like(v).at[order].set(v), v, ct)
  got = value_and_grad(lambda v: permute(v, inverse, order), v, ct)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("seed, rows, groups, pad", [(3, 64, 8, 0), (4, 256, 2, 100)])
def test_sort_equals_the_gather_it_replaces_forward_and_backward(seed, rows, groups, pad):
  order, inverse, v, ct = sorted_rows(seed, rows, groups, pad)
  want = value_and_grad(lambda v: v[order], v, ct)
  got = value_and_grad(lambda v: permute(v, order, inverse), v, ct)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("preset", ["expert", "dp"])
def test_tpu_step_sorts_and_unsorts_rows_without_scatters(preset):
  """The tiny dropless MoE LM's train step (d_model 32, k 2, 8 experts; T = 32 tokens and
  T x k = 64 rows a device, a 256-row receive buffer under expert parallelism) as libtpu
  compiles it for a v5e:2x2: the one scatter left that writes rows of d_model is the
  scatter-add summing each token's k copy gradients into its T rows (the transpose of the
  token-copy gather). With the scatter forms (before) there were 6 with 'expert': also the
  u32[256,32] and u32[64,32] update-id scatters of the two un-sorts' JVP, their f32
  scatter-adds and the scatter-add transposing the gather by expert of the received rows;
  3 with 'dp'."""
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  from test_moe_dropless import tiny_dropless
  exp = tiny_dropless(preset, (4,), ("data",), "mesh.topology='v5e:2x2'", "model.moe.expert_buffer=None")
  _, setup = dry_run.prepare(exp)
  assert setup.mesh.devices.flat[0].platform == "tpu"
  module = hlo_lib.parse(dry_run.compile_step(setup).as_text())
  scatters = [i for i in module if i.opcode == "scatter"]
  assert scatters, "the step still has its small scatters (expert counts): is this the step?"
  rows = [i for i in scatters if len(i.results[0].dims) == 2 and i.results[0].dims[1] == 32]
  assert [(i.results[0].dtype, i.results[0].dims) for i in rows] == [("f32", (32, 32))], [i.line[:120] for i in rows]
