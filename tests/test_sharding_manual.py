"""sharding/manual.py: manual (shard_map) regions stated in logical axes.

Each device's body must see exactly the block of every operand that the rules in force give
its logical dims: checked by what the body computes from its block, reassembled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardax.sharding import MeshConfig, make_mesh, manual, rules as rules_lib, use_rules


@pytest.fixture(scope="module")
def mesh24():
  return make_mesh(MeshConfig(ici=(2, 4), axes=("data", "model")))


def _block_sums(x: np.ndarray, parts: tuple[int, ...]) -> np.ndarray:
  """x with every block (x cut into parts[i] equal pieces along dim i) set to its sum."""
  out = np.empty_like(x)
  for index in np.ndindex(*parts):
    sl = tuple(slice(i * n // p, (i + 1) * n // p) for i, n, p in zip(index, x.shape, parts))
    out[sl] = x[sl].sum()
  return out


def test_each_device_gets_the_block_the_rules_give_its_logical_dims(mesh24):
  """The 2d preset's order rule: in an activation [batch, length, embed], `batch` takes
  `data` first, so `embed` falls through to `model`. A body that replaces its block by the
  block's sum shows which cut each device got."""
  x = np.random.default_rng(0).normal(size=(4, 3, 8)).astype(np.float32)
  with jax.set_mesh(mesh24), use_rules(rules_lib.PRESETS["2d"]):
    act = manual.layout(("batch", "length", "embed"), x.shape, name="activation")
    got = jax.jit(manual.run(lambda b: jnp.full_like(b, jnp.sum(b)), (act,), act))(x)
  assert act.spec == P("data", None, "model")
  np.testing.assert_allclose(got, _block_sums(x, (2, 1, 4)), rtol=1e-5)


def test_select_splits_a_parameter_like_one_dim_of_an_activation(mesh24):
  """Rules where `heads` alone would take `data`, but in q [batch, length, heads, kv] batch
  took it first, so heads fall through to `model`. A per-head parameter selected from q's
  layout must arrive cut like q's heads: q + s per device equals q + s globally."""
  rules = (("batch", "data"), ("heads", "data"), ("heads", "model"))
  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, 4, 8, 3)).astype(np.float32)
  s = rng.normal(size=(8,)).astype(np.float32)
  with jax.set_mesh(mesh24), use_rules(rules):
    q_layout = manual.layout(("batch", "length", "heads", "kv"), q.shape)
    fn = manual.run(lambda q, s: q + s[None, None, :, None], (q_layout, q_layout.select(2)), q_layout)
    got = jax.jit(fn)(q, s)
    assert manual.layout(("heads",), s.shape).spec == P("data")   # why `select` exists
    assert q_layout.select(2).spec == P("model") and q_layout.parts(2) == 4
  np.testing.assert_allclose(got, q + s[None, None, :, None], rtol=1e-6)


def test_whole_dims_enter_whole_and_none_arguments_pass_through(mesh24):
  rules = (("batch", "data"), ("heads", "model"))
  x = np.ones((2, 8), np.float32)
  with jax.set_mesh(mesh24), use_rules(rules):
    lay = manual.layout(("batch", "heads"), x.shape)
    width = lambda lay: jax.jit(manual.run(lambda b, none: jnp.full_like(b, b.shape[1] + (none is None)),
                                           (lay, lay), lay))(x, None)
    np.testing.assert_array_equal(width(lay), 8 // 4 + 1)
    np.testing.assert_array_equal(width(lay.whole(1)), 8 + 1)


def test_without_mesh_or_rules_the_function_itself_and_every_dim_whole(mesh24):
  fn = lambda x: x
  assert manual.run(fn, ((),), ()) is fn
  assert manual.layout(("batch", "heads")).axes == ((), ())
  with jax.set_mesh(mesh24):                       # a mesh but no rules
    assert not manual.active() and manual.run(fn, ((),), ()) is fn


def test_a_dim_the_mesh_does_not_divide_is_named_with_the_fix(mesh24):
  with jax.set_mesh(mesh24), use_rules(rules_lib.PRESETS["dp"]):
    with pytest.raises(ValueError, match=r"flash attention q: dim 0 \('batch'\) has size 3.*allow_uneven"):
      manual.layout(("batch", "length", "heads", "kv"), (3, 8, 4, 2), name="flash attention q")
    with pytest.raises(ValueError, match=r"tokens: logical axes \('batch',\) name 1 dims.*\(3, 8\)"):
      manual.layout(("batch",), (3, 8), name="tokens")


def test_a_transposed_weight_arrives_cut_like_its_weight_and_a_scalar_leaves_replicated(mesh24):
  """An expert weight [expert, embed, mlp] and its down projection [expert, mlp, embed] given by
  `select(0, 2, 1)` (layers/moe_dispatch.py): each device's blocks must line up (w + wo^T per
  block is 2 w), and a count summed over every device leaves as one replicated scalar,
  `Layout(())`, beside an output cut like w."""
  rules = (("batch", "data"), ("expert", "data"), ("mlp", "model"))
  w = np.random.default_rng(2).normal(size=(4, 3, 8)).astype(np.float32)
  with jax.set_mesh(mesh24), use_rules(rules):
    w_in = manual.layout(("expert", "embed", "mlp"), w.shape, name="expert weight")
    body = lambda w, wo: (w + jnp.swapaxes(wo, 1, 2), jax.lax.psum(jnp.sum(w), ("data", "model")))
    got, total = jax.jit(manual.run(body, (w_in, w_in.select(0, 2, 1)), (w_in, manual.Layout(()))))(
        w, np.swapaxes(w, 1, 2))
  assert w_in.select(0, 2, 1).spec == P("data", "model", None)
  np.testing.assert_allclose(got, 2 * w, rtol=1e-6)
  np.testing.assert_allclose(total, w.sum(), rtol=1e-5)
