"""What the expert-parallel exchange moves, and what the backward pass moves again.

A 4-device expert-parallel FFN (`dropless_expert_parallel` in a shard_map, the padded
exchange: XLA:CPU has no ragged_all_to_all; tests/test_moe_exchange.py compiles the ragged
one for a TPU) differentiated under a remat policy or with `fp8_dispatch`; the jaxpr says
which all-to-alls and matmuls run, the values say they compute the same thing.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardax.configs.errors import ConfigError
from shardax.configs.moe import MoEConfig
from shardax.layers import REMAT_POLICIES
from shardax.layers.moe_dispatch import dropless_expert_parallel
from meshtools import equations

N, E, TOKENS = 4, 8, 24   # devices, experts, tokens per device


def expert_parallel_ffn(index, gates, fp8: bool = False):
  """(x [N*TOKENS, m], *weights) -> y: the expert-parallel FFN over N devices."""
  mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:N])
  body = lambda x, i, g, *w: dropless_expert_parallel(x, i, g, w, jax.nn.silu, axes="x", n=N, num_experts=E,
                                                      buffer=2.0, exchange="padded", impl="tiled",
                                                      fp8_dispatch=fp8)[0]
  # check_vma=False as layers/moe_dispatch.py's own shard_map
  ffn = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"), check_vma=False)
  return lambda x, *w: ffn(x, index, gates, *w)


def routing(rng, gates=None):
  index = jnp.asarray(rng.integers(0, E, size=(N * TOKENS, 2)), jnp.int32)
  gates = rng.uniform(size=(N * TOKENS, 2)) if gates is None else rng.choice(gates, size=(N * TOKENS, 2))
  return index, jnp.asarray(gates, jnp.float32)


def expert_weights(rng, m: int, h: int = 8):
  return tuple(jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((E, m, h), (E, m, h), (E, h, m)))


def all_to_all_dtypes(jaxpr) -> list[str]:
  return [str(e.invars[0].aval.dtype) for e in equations(jaxpr) if e.primitive.name == "all_to_all"]


def test_moe_returned_remat_keeps_the_return_exchange_out_of_the_recompute():
  """remat='moe_returned' saves the experts' gate/up outputs and their outputs back on the
  token side ('expert_returned'): the backward of a checkpointed expert-parallel FFN then
  recomputes only the dispatch exchange, not the return exchange nor any expert matmul
  (against 'full': one all-to-all and 3 matmuls fewer), with the same gradients. Fails with
  the name left off the returned rows (the return exchange and the down matmul come back)."""
  rng = np.random.default_rng(0)
  ffn = expert_parallel_ffn(*routing(rng))
  weights = expert_weights(rng, 16)
  x = jnp.asarray(rng.normal(size=(N * TOKENS, 16)), jnp.float32)
  loss = lambda w, x: jnp.sum(ffn(x, *w) ** 2)
  grads, dots, exchanges = {}, {}, {}
  for remat in ("full", "moe_returned"):
    f = jax.grad(jax.checkpoint(loss, policy=REMAT_POLICIES[remat]), argnums=(0, 1))
    grads[remat] = jax.jit(f)(weights, x)
    names = [e.primitive.name for e in equations(jax.make_jaxpr(f)(weights, x).jaxpr)]
    dots[remat], exchanges[remat] = names.count("dot_general"), names.count("all_to_all")
  assert dots["moe_returned"] == dots["full"] - 3, dots
  assert exchanges["moe_returned"] == exchanges["full"] - 1, exchanges
  for a, b in zip(jax.tree.leaves(grads["moe_returned"]), jax.tree.leaves(grads["full"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fp8_dispatch_sends_what_goes_to_the_experts_in_fp8():
  """model.moe.fp8_dispatch: what travels to the experts goes in fp8 with a power-of-two scale
  per 128 columns: the rows, and in the backward the gradient of the expert outputs; the
  outputs and the rows' gradient come back unquantized (DeepSeek-V3's dispatch and combine).
  With gates and a loss gradient that fp8 holds exactly, the loss and every gradient equal
  those of the unquantized exchange fed the rows as fp8 holds them (computed here with
  ml_dtypes); with another loss the gradients differ by the rounding of the outputs'
  gradient. The program: 1 f8 all-to-all forward, 1 more backward. Fails with the rows or
  the outputs' gradient sent unquantized, or the rows' gradient sent through the rounding."""
  rng = np.random.default_rng(0)
  m = 256
  index, gates = routing(rng, gates=[0.5, 1.0])
  weights = expert_weights(rng, m)
  c = jnp.asarray(rng.choice([0, 0.5, 1, 1.5, 2, 3, -0.5, -1, -2, -3], size=(N * TOKENS, m)), jnp.float32)
  loss_fn = lambda fp8, loss: (lambda w, x: loss(expert_parallel_ffn(index, gates, fp8)(x, *w)))

  x = rng.normal(size=(N * TOKENS, m)).astype(np.float32)
  blocks = x.reshape(N * TOKENS, m // 128, 128)      # the rows as fp8 holds them, computed here
  scale = 2.0 ** np.ceil(np.log2(np.abs(blocks).max(-1, keepdims=True) / 448))
  held = ((blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale).reshape(x.shape)
  grad = lambda f, loss, x: jax.jit(jax.value_and_grad(loss_fn(f, loss), argnums=(0, 1)))(weights, jnp.asarray(x))
  linear, square = (lambda y: jnp.sum(y * c)), (lambda y: jnp.sum(y ** 2))
  (l8, g8), (lh, gh), (l, _) = grad(True, linear, x), grad(False, linear, held), grad(False, linear, x)
  np.testing.assert_allclose(l8, lh, rtol=1e-6)        # = the unquantized exchange at the rows fp8 holds
  for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(gh)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
  assert l8 != l, l                                    # and they differ from x's by fp8's rounding
  (_, g8), (_, gh) = grad(True, square, x), grad(False, square, held)
  off = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(gh))]
  assert all(0 < d < 0.1 for d in off), off            # the outputs' gradient rounded on its way
  fp8 = lambda f: all_to_all_dtypes(jax.make_jaxpr(f)(weights, jnp.asarray(x)).jaxpr).count("float8_e4m3fn")
  assert fp8(loss_fn(True, square)) == 1 and fp8(jax.grad(loss_fn(True, square), argnums=(0, 1))) == 2


def test_fp8_dispatch_is_refused_where_nothing_is_exchanged_by_rows():
  """The capacity dispatch moves [E, C] slot tensors, not routed rows: fp8_dispatch is refused
  at config time, naming the fix. (Without expert parallelism a dropless layer exchanges
  nothing, and the option then changes nothing.)"""
  with pytest.raises(ConfigError, match="fp8_dispatch=True is for model.moe.dispatch='dropless'"):
    MoEConfig(dispatch="capacity", fp8_dispatch=True)
  assert MoEConfig(dispatch="dropless", top_k=2, fp8_dispatch=True).fp8_dispatch
