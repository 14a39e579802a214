"""Group-limited routing (layers/routers.py `group_limit`, DeepSeek-V3's n_group / topk_group):
experts come only from the chosen groups, the groups are those whose two best (biased) scores
sum highest, n_group=1 is plain top-k, and an MoE LM routing this way computes under expert
parallelism what it computes on one device (dropless and capacity dispatch)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.configs.schema import ConfigError
from shardax.layers import routers
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, setup_for

E, G, TOPK_GROUP = 16, 4, 2


def groups_by_top2_sum(choose: np.ndarray) -> np.ndarray:
  """[tokens, G] bool: the TOPK_GROUP groups of highest top-2 sum, per token."""
  top2 = np.sort(choose.reshape(-1, G, E // G), axis=-1)[..., -2:].sum(-1)
  best = np.argsort(-top2, axis=-1, kind="stable")[:, :TOPK_GROUP]
  return np.any(best[..., None] == np.arange(G), axis=1)


@pytest.mark.parametrize("score", ["sigmoid", "softmax"])
def test_experts_come_only_from_the_groups_of_highest_top2_sum(score):
  logits = jax.random.normal(jax.random.key(0), (4, 32, E)) * 2
  bias = jax.random.normal(jax.random.key(1), (E,)) * 0.3
  r = jax.jit(lambda l, b: routers.route(l, top_k=4, score=score, bias=b, n_group=G, topk_group=TOPK_GROUP)
              )(logits, bias)
  scores = np.asarray(routers.scores_of(logits, score)).reshape(-1, E)
  chosen_groups = groups_by_top2_sum(scores + np.asarray(bias))
  index = np.asarray(r.index).reshape(-1, 4)
  assert np.all(np.take_along_axis(chosen_groups, index // (E // G), axis=1))
  # ... and they are the top-4 of the biased scores within those groups; gates the unbiased ones.
  allowed = np.repeat(chosen_groups, E // G, axis=1)
  want = np.argsort(-np.where(allowed, scores + np.asarray(bias), -np.inf), axis=-1)[:, :4]
  np.testing.assert_array_equal(np.sort(index, -1), np.sort(want, -1))
  gates = np.take_along_axis(scores, index, 1)
  np.testing.assert_allclose(np.asarray(r.gates).reshape(-1, 4), gates / gates.sum(-1, keepdims=True),
                             rtol=1e-5)


def test_the_best_expert_is_left_out_when_its_group_is_weak():
  """Group 0 holds the single best expert but nothing else; group 1 two good ones: with one
  group allowed, the token goes to group 1 (top-2 sums 0.9 + 0.1 < 0.8 + 0.7)."""
  scores = np.full((1, 1, 8), 0.05, np.float32)
  scores[0, 0, [0, 1]] = [0.9, 0.1]
  scores[0, 0, [4, 5]] = [0.8, 0.7]
  logits = jnp.log(scores / (1 - scores))   # sigmoid(logits) = scores
  plain = routers.route(logits, top_k=2, score="sigmoid")
  limited = routers.route(logits, top_k=2, score="sigmoid", n_group=2, topk_group=1)
  assert sorted(np.asarray(plain.index).ravel()) == [0, 4]
  assert sorted(np.asarray(limited.index).ravel()) == [4, 5]


def test_one_group_is_plain_top_k():
  logits = jax.random.normal(jax.random.key(2), (2, 16, E))
  bias = jax.random.normal(jax.random.key(3), (E,))
  plain = routers.route(logits, top_k=3, score="sigmoid", bias=bias)
  one = routers.route(logits, top_k=3, score="sigmoid", bias=bias, n_group=1, topk_group=1)
  all_groups = routers.route(logits, top_k=3, score="sigmoid", bias=bias, n_group=G, topk_group=G)
  for r in (one, all_groups):
    np.testing.assert_array_equal(np.asarray(r.index), np.asarray(plain.index))
    np.testing.assert_array_equal(np.asarray(r.gates), np.asarray(plain.gates))


def test_capacity_gating_picks_both_experts_within_the_chosen_groups():
  logits = jax.random.normal(jax.random.key(4), (2, 32, E)) * 2
  g = routers.top2_gating(logits, capacity=32, second_expert="all", n_group=G, topk_group=TOPK_GROUP)
  gates = np.asarray(jax.nn.softmax(logits, -1)).reshape(-1, E)
  chosen_groups = groups_by_top2_sum(gates)
  index = np.asarray(g.index).reshape(-1, 2)
  assert np.all(np.take_along_axis(chosen_groups, index // (E // G), axis=1))
  plain = routers.top2_gating(logits, capacity=32, second_expert="all")
  assert not np.array_equal(np.asarray(plain.index), np.asarray(g.index))   # the limit bites here


def tiny_grouped(preset, ici, axes, *more):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, [
      "model.d_model=32", "model.num_heads=4", "model.d_ff=64", "model.num_layers=1",
      "model.max_len=16", "model.moe.d_ff=32", "data.seq_len=16", "train.global_batch=8",
      "model.moe.every=1", "model.moe.num_experts=16", "model.moe.n_group=4", "model.moe.topk_group=2",
      "data.source='synthetic'", f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}",
      *more])
  return configs.build(cfg)


DROPLESS = ("model.moe.dispatch='dropless'", "model.moe.top_k=4", "model.moe.score='sigmoid'",
            "model.moe.bias_update_rate=1e-3", "model.moe.gate_scale=2.5")
CAPACITY = ("model.moe.dispatch='capacity'", "model.moe.second_expert='all'")


@pytest.mark.parametrize("dispatch", [DROPLESS, CAPACITY], ids=["dropless", "capacity"])
def test_expert_parallel_equals_one_device(dispatch):
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  one = setup_for(tiny_grouped("dp", (1,), ("data",), *dispatch), jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(one)(jax.random.key(0))["params"])
  (ref_loss, ref_grads, _), _ = loss_and_grads(one, params, batch)
  (loss, grads, _), _ = loss_and_grads(setup_for(tiny_grouped("expert", (8,), ("data",), *dispatch)),
                                       params, batch)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("override,field", [
    ("model.moe.n_group=3", "model.moe.n_group"),
    ("model.moe.topk_group=5", "model.moe.topk_group"),
    ("model.moe.n_group=16", "model.moe.n_group"),
    ("model.moe.top_k=9", "model.moe.top_k"),
])
def test_config_errors_name_the_field(override, field):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, ["model.moe.num_experts=16", "model.moe.n_group=4", "model.moe.topk_group=2",
                                "model.moe.dispatch='dropless'", override])
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    configs.build(cfg)
