"""The dropless dispatch's row reorderings (layers/moe_dispatch.py: `permute`, `token_copies`).

The dispatch sorts the T x k token copies by expert, and under expert parallelism sorts the
received rows (padding last) again; after the expert matmuls both orders are undone. Each
undo is a permutation of all rows (padding rows included: grouped_ffn gives them 0), written
before as a scatter, `zeros.at[order].set(out)`. `permute` writes it as the gather
out[argsort(order)] with a gather for its backward too. Here: it computes exactly what the
scatter did, forward and backward, on random permutations with and without padding rows;
and in a step compiled by libtpu (no TPU needed) no scatter moves rows any more.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.layers.moe_dispatch import permute, token_copies
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


@pytest.mark.parametrize("k", [1, 2, 8])
def test_token_copies_equal_the_gather_they_replace(k):
  """Forward the same gather; backward each token's k copy gradients summed (a scatter-add
  before, a gather and a sum over k now): bit-equal for k <= 2, to rounding beyond."""
  t, e = 16, 5
  order, inverse, _, ct = sorted_rows(k, t * k, e, 0)
  x = jnp.asarray(np.random.default_rng(10 + k).standard_normal((t, M)), jnp.float32)
  want = value_and_grad(lambda x: x[order // k], x, ct)
  got = value_and_grad(lambda x: token_copies(x, order, inverse, k), x, ct)
  np.testing.assert_array_equal(got[0], want[0])
  if k <= 2:
    np.testing.assert_array_equal(got[1], want[1])
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset", ["expert", "dp"])
def test_tpu_step_moves_no_rows_by_scatter(preset):
  """The tiny dropless MoE LM's train step (d_model 32, k 2, 8 experts; T x k = 64 rows a
  device, a 256-row receive buffer under expert parallelism) as libtpu compiles it for a
  v5e:2x2: no scatter writes rows of d_model. With the scatter forms (before) it had, with
  'expert', 6: the u32[256,32] and u32[64,32] update-id scatters of the two un-sorts' JVP,
  their f32 scatter-adds, and the scatter-adds transposing the two gathers (recv by expert,
  the token copies); with 'dp' 3 of them."""
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  from test_moe_dropless import tiny_dropless
  exp = tiny_dropless(preset, (4,), ("data",), "mesh.topology='v5e:2x2'", "model.moe.expert_buffer=None")
  _, setup = dry_run.prepare(exp)
  assert setup.mesh.devices.flat[0].platform == "tpu"
  module = hlo_lib.parse(dry_run.compile_step(setup).as_text())
  scatters = [i for i in module if i.opcode == "scatter"]
  assert scatters, "the step still has its small scatters (expert counts): is this the step?"
  rows = [i.line.strip()[:120] for i in scatters if len(i.results[0].dims) == 2 and i.results[0].dims[1] == 32]
  assert rows == [], rows
