"""gpt-oss's expert pieces: the router bias, expert biases and the clamped SwiGLU (layers/glu.py)
on every dispatch path (ragged_dot, tiled, megablox; capacity) and their config refusals. The
sharded runs of a model with them: tests/test_attention_sinks.py (a tiny gpt-oss-shaped LM)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax.configs.moe import MoEConfig
from shardax.configs.schema import ConfigError
from shardax.layers import moe_dispatch as md
from shardax.layers.glu import ClampedSwiGLU
from shardax.layers.moe import MoEFeedForward


def _ffn_reference(xs, experts, w_gate, w_up, wo, b_gate, b_up, glu):
  """Each row through its own expert's weights and biases (the definition, row by row)."""
  row = lambda w, x: jnp.einsum("ri,rio->ro", x, w[experts])
  return row(wo, glu(row(w_gate, xs) + b_gate[experts], row(w_up, xs) + b_up[experts]))


@pytest.mark.parametrize("impl", ["ragged_dot", "tiled", pytest.param("megablox", marks=pytest.mark.slow)])
def test_grouped_ffn_adds_each_rows_expert_biases_and_clamps(impl):
  """Rows sorted by expert (an empty group, rows past the groups come out 0): the gate/up
  biases of each row's own expert and the clamped SwiGLU, forward and gradients, as a
  per-row loop computes them (megablox: Pallas' interpreter, its tile-sized widths)."""
  rng = np.random.default_rng(0)
  r, m, h, e = (30, 128, 128, 4) if impl == "megablox" else (30, 8, 16, 4)
  sizes = jnp.array([7, 0, 12, 6], jnp.int32)
  xs = jnp.asarray(rng.normal(size=(r, m)), jnp.float32)
  ws = [jnp.asarray(rng.normal(size=s) * 0.5, jnp.float32) for s in [(e, m, h), (e, m, h), (e, h, m)]]
  bias = [jnp.asarray(rng.normal(size=(e, h)), jnp.float32) for _ in range(2)]
  glu = ClampedSwiGLU(1.702, 0.7)
  experts = np.repeat(np.arange(e), np.asarray(sizes))
  n = len(experts)

  def got(xs, *p):
    return md.grouped_ffn(xs, sizes, *p[:3], glu, impl, bias=tuple(p[3:]))

  def want(xs, *p):
    return _ffn_reference(xs[:n], experts, *p, glu)

  out = jax.jit(got)(xs, *ws, *bias)
  np.testing.assert_allclose(out[:n], jax.jit(want)(xs, *ws, *bias), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out[n:], 0)
  cot = jnp.asarray(rng.normal(size=(n, m)), jnp.float32)
  g1 = jax.jit(jax.grad(lambda *a: jnp.sum(got(*a)[:n] * cot), argnums=tuple(range(6))))(xs, *ws, *bias)
  g2 = jax.jit(jax.grad(lambda *a: jnp.sum(want(*a) * cot), argnums=tuple(range(6))))(xs, *ws, *bias)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a[:n] if a.shape[0] == r else a, b[:n] if b.shape[0] == r else b,
                               rtol=1e-4, atol=1e-5)
  assert float(jnp.max(jnp.abs(glu(jnp.full((3,), 5.0), jnp.full((3,), -5.0))))) == pytest.approx(
      abs((1 - 0.7) * 0.7 / (1 + math.exp(-1.702 * 0.7))), rel=1e-6)


def _layer(cfg):
  with nnx.use_eager_sharding(False):
    layer = MoEFeedForward(16, cfg, rngs=nnx.Rngs(3))
  graphdef, state = nnx.split(layer)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(5)
  for name in ("wi_gate_bias", "wi_up_bias", "wo_bias"):
    params[name] = jnp.asarray(rng.normal(size=params[name].shape), jnp.float32)
  params["router"]["bias"] = jnp.asarray(rng.normal(size=params["router"]["bias"].shape), jnp.float32)

  def apply(p, x):
    st = nnx.State(state)
    nnx.replace_by_pure_dict(st, p)
    return nnx.merge(graphdef, st)(x, deterministic=True)[0]
  return params, apply


def test_capacity_and_dropless_dispatch_agree_with_biases_and_clamp():
  """With room for every token (capacity = group size), GShard's top-2 capacity dispatch and the
  dropless top-2 give the same output: the router bias, expert biases (the down bias by each
  copy's gate) and the clamp reach both paths alike."""
  base = MoEConfig(num_experts=4, d_ff=8, top_k=2, router_bias=True, expert_bias=True, swiglu_limit=0.5,
                   capacity_factor=4.0, second_expert="all", min_capacity=12)
  params, dropless = _layer(dataclasses.replace(base, dispatch="dropless", grouped_matmul="tiled"))
  _, capacity = _layer(dataclasses.replace(base, dispatch="capacity"))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, 16)), jnp.float32)
  a, b = jax.jit(dropless)(params, x), jax.jit(capacity)(params, x)
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  zeroed = {**params, "wo_bias": jnp.zeros_like(params["wo_bias"])}
  assert float(jnp.max(jnp.abs(a - jax.jit(dropless)(zeroed, x)))) > 1e-2


def test_moe_options_are_refused_where_they_do_not_compose():
  with pytest.raises(ConfigError, match="expert_overflow='drop'"):
    MoEConfig(dispatch="dropless", expert_bias=True, expert_overflow="drop", expert_buffer=1.0)
  with pytest.raises(ConfigError, match="num_shared_experts"):
    MoEConfig(dispatch="dropless", swiglu_limit=7.0, num_shared_experts=1)
  with pytest.raises(ConfigError, match="swiglu_limit"):
    MoEConfig(swiglu_limit=0.0)
