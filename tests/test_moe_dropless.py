"""Dropless MoE (top-k routers, grouped matmul, shared experts, bias balancing).

The reference is a per-token loop written from the routers' definitions (Mixtral: softmax
top-2 renormalized; Switch: top-1 unnormalized; DeepSeek-V3: sigmoid top-k, renormalized,
scaled, chosen with a bias, plus a shared expert): each token's output is the gate-weighted
sum of its chosen experts' gated FFNs. It never sorts, groups or exchanges tokens, so
the layer's dispatch (argsort, ragged_dot, all-to-all) must reproduce it exactly, in the
outputs and in the gradients of every weight and of the input.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax.configs.moe import MoEConfig
from shardax.layers import routers
from shardax.layers.moe import MoEFeedForward

D, H = 16, 8


def reference(params, x, cfg):
  """The MoE FFN of x [b, l, m], one token at a time."""
  act = jax.nn.silu
  kernel = params["router"]["kernel"]
  out = []
  for t in x.reshape(-1, x.shape[-1]):
    logits = t @ kernel
    scores = jax.nn.softmax(logits) if cfg.score == "softmax" else jax.nn.sigmoid(logits)
    bias = params.get("balance_bias", jnp.zeros_like(scores))
    chosen = jnp.argsort(-jax.lax.stop_gradient(scores + bias), stable=True)[:cfg.top_k]
    gates = scores[chosen]
    if cfg.renormalize:
      gates = gates / jnp.sum(gates)
    y = jnp.zeros_like(t)
    for j in range(cfg.top_k):
      e, g = chosen[j], gates[j] * cfg.gate_scale
      h = act(t @ params["wi_gate"][e]) * (t @ params["wi_up"][e])
      y = y + g * (h @ params["wo"][e])
    if "shared" in params:
      s = params["shared"]
      y = y + (act(t @ s["gate"]["kernel"]) * (t @ s["up"]["kernel"])) @ s["down"]["kernel"]
    out.append(y)
  return jnp.stack(out).reshape(x.shape)


CASES = {
    "top1_switch": MoEConfig(num_experts=8, d_ff=H, top_k=1, renormalize=False, dispatch="dropless"),
    "top2_mixtral": MoEConfig(num_experts=8, d_ff=H, top_k=2, dispatch="dropless"),
    "top8_deepseek_shared": MoEConfig(num_experts=16, d_ff=H, top_k=8, score="sigmoid",
                                      gate_scale=2.5, num_shared_experts=1, bias_update_rate=1e-3,
                                      dispatch="dropless"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dropless_equals_a_per_token_loop(case):
  cfg = CASES[case]
  with nnx.use_eager_sharding(False):
    layer = MoEFeedForward(D, cfg, rngs=nnx.Rngs(3))
  graphdef, state = nnx.split(layer)
  params = nnx.to_pure_dict(state)
  if "balance_bias" in params:   # a bias that changes some choices, as training would set it
    params["balance_bias"] = jnp.asarray(np.random.default_rng(0).normal(size=cfg.num_experts) * 0.1,
                                         jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, D)), jnp.float32)

  def layer_out(p, x):
    st = nnx.State(state)
    nnx.replace_by_pure_dict(st, p)
    return nnx.merge(graphdef, st)(x)[0]

  def loss(fn):
    return lambda p, x: jnp.sum(jnp.sin(fn(p, x)))   # weights every output differently

  got = jax.jit(layer_out)(params, x)
  want = reference(params, x, cfg)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  g_got = jax.jit(jax.grad(loss(layer_out), argnums=(0, 1)))(params, x)
  g_want = jax.grad(loss(lambda p, x: reference(p, x, cfg)), argnums=(0, 1))(params, x)
  flat_got, flat_want = jax.tree.leaves_with_path(g_got), jax.tree.leaves(g_want)
  assert len(flat_got) == len(flat_want) >= 5
  for (path, a), b in zip(flat_got, flat_want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=jax.tree_util.keystr(path))
  router_grad = g_got[0]["router"]["kernel"]
  if cfg.top_k > 1 or not cfg.renormalize:
    assert np.abs(router_grad).max() > 1e-4   # the gates carry the router's gradient
  if "balance_bias" in params:
    assert np.abs(g_got[0]["balance_bias"]).max() == 0   # selection only: no gradient


def test_bias_balancing_moves_a_skewed_router_to_uniform_load():
  """DeepSeek-V3's auxiliary-loss-free update on a router that prefers a few experts: 512
  tokens, 16 experts, top-2 of sigmoid scores with +2, +1.5, +1 added to experts 0-2's
  logits. The router never trains; only the bias moves (rate 0.01), 50 steps. Measured
  (2026-11-23): the top expert's load 5.30 fair shares -> 1.16, the mean |load - 1| 0.955
  -> 0.086."""
  e, k, rate = 16, 2, 0.01
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(512, e)), jnp.float32).at[:, :3].add(jnp.array([2.0, 1.5, 1.0]))

  @jax.jit
  def step(bias, _):
    r = routers.route(logits, top_k=k, score="sigmoid", bias=bias)
    return routers.next_bias(bias, r.load, rate), r.load

  _, loads = jax.lax.scan(step, jnp.zeros((e,), jnp.float32), None, length=51)
  first, last = np.asarray(loads[0]) * e, np.asarray(loads[-1]) * e   # 1.0 = a fair share
  assert first.max() > 5.0, first                  # skewed: the top expert takes > 5 fair shares
  assert last.max() < 1.25 and last.min() > 0.75, last
  assert np.abs(first - 1).mean() > 0.9 and np.abs(last - 1).mean() < 0.15


def test_capacity_dispatch_rejects_routers_it_cannot_run():
  with pytest.raises(Exception, match="model.moe.dispatch='capacity' is GShard"):
    MoEConfig(top_k=4)
  with pytest.raises(Exception, match="model.moe.top_k=9"):
    MoEConfig(num_experts=8, top_k=9, dispatch="dropless")
