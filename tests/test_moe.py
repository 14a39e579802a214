"""GShard MoE: gating against a loop reference, expert parallelism == one device, training.

The gating reference below is a plain per-group loop over tokens, written from
GShard's Algorithm 1 (arXiv 2006.16668); the layer computes the same thing with
cumsums and one-hots. The random draws ('random', 'sampling') are taken from the
same key and handed to the reference, so the comparison is exact.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.configs.moe import MoEConfig
from shardax.layers.moe import top2_gating
from shardax.sharding import report
from shardax.trainer import loop
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, setup_for


# ---------------------------------------------------------------- gating vs. a loop reference

def reference_gating(logits, capacity, policy, uniform=None, gumbel=None):
  """GShard Algorithm 1, one token at a time. Returns (combine, index, kept, aux, g2)."""
  g_n, s_n, e_n = logits.shape
  combine = np.zeros((g_n, s_n, e_n, capacity))
  index = np.zeros((g_n, s_n, 2), int)
  kept = np.zeros((g_n, s_n, 2), bool)
  g2_all = np.zeros((g_n, s_n))
  aux = 0.0
  for g in range(g_n):
    z = np.exp(logits[g] - logits[g].max(-1, keepdims=True))
    gates = z / z.sum(-1, keepdims=True)
    count = np.zeros(e_n, int)
    for s in range(s_n):
      e1 = gates[s].argmax()
      if policy == "sampling":
        e2 = np.where(np.arange(e_n) == e1, -np.inf, logits[g, s] + gumbel[g, s]).argmax()
      else:
        e2 = np.where(np.arange(e_n) == e1, -1.0, gates[s]).argmax()
      index[g, s] = e1, e2
      g2_all[g, s] = gates[s, e2] / (gates[s, e1] + gates[s, e2])
    ce = np.bincount(index[g, :, 0], minlength=e_n) / s_n
    aux += (gates.mean(0) * ce).sum() * e_n / g_n   # E^2 * mean_e(me * ce), mean over groups
    for choice in (0, 1):                           # all first choices queue before all seconds
      for s in range(s_n):
        e, weight = index[g, s, choice], (1 - g2_all[g, s]) if choice == 0 else g2_all[g, s]
        if choice == 1 and policy == "random" and not uniform[g, s] < 2 * weight:
          continue
        if count[e] < capacity:
          kept[g, s, choice] = True
          combine[g, s, e, count[e]] = weight
          count[e] += 1
  return combine, index, kept, aux, g2_all


@pytest.mark.parametrize("policy", ["all", "random", "sampling"])
def test_gating_matches_loop_reference(policy):
  g, s, e = 3, 24, 6
  cfg = MoEConfig(num_experts=e, capacity_factor=0.75, min_capacity=2, second_expert=policy)
  capacity = cfg.capacity(s)
  assert capacity == max(2, math.ceil(0.75 * 2 * s / e)) == 6
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(g, s, e)).astype(np.float32) * 2
  logits[..., 0] += 1.5                            # a popular expert, so capacity bites
  # The draws top2_gating makes from this key, handed to the reference.
  got, uniform, gumbel = jax.jit(lambda l, k: (
      top2_gating(l, capacity, policy, k), jax.random.uniform(k, (g, s), jnp.float32),
      jax.random.gumbel(k, (g, s, e), jnp.float32)))(logits, jax.random.key(7))
  uniform, gumbel = np.asarray(uniform), np.asarray(gumbel)
  combine, index, kept, aux, g2 = reference_gating(logits.astype(np.float64), capacity, policy,
                                               uniform, gumbel)
  np.testing.assert_array_equal(np.asarray(got.index), index)
  np.testing.assert_array_equal(np.asarray(got.kept), kept)
  np.testing.assert_allclose(np.asarray(got.combine), combine, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got.dispatch), combine > 0)
  np.testing.assert_allclose(float(got.aux_loss), aux, rtol=1e-5)
  # The case exercises what it should: drops happen, and 'random' skips some second choices.
  assert not kept[..., 0].all()
  np.testing.assert_allclose(float(got.metrics["top1_overflow"]), 1 - kept[..., 0].mean(), atol=1e-6)
  np.testing.assert_allclose(float(got.metrics["dropped_fraction"]), (~kept.any(-1)).mean(), atol=1e-6)
  assert (np.asarray(got.dispatch).sum(1) <= 1).all()   # a slot holds at most one token
  if policy == "random":
    assert (uniform >= 2 * g2).any()                    # some second choices were skipped


def test_balance_loss_is_one_when_uniform_and_e_when_collapsed():
  e = 4
  # Near-equal gates, first choices spread evenly: the loss' minimum, 1.
  gating = jax.jit(top2_gating, static_argnums=1)
  uniform = gating(1e-3 * jax.nn.one_hot(jnp.arange(8) % e, e)[None], 8)
  np.testing.assert_allclose(float(uniform.aux_loss), 1.0, rtol=1e-2)
  # Every token on expert 0 with all the gate: the maximum, E.
  collapsed = gating(jnp.zeros((1, 8, e)).at[..., 0].set(30.0), 8)
  np.testing.assert_allclose(float(collapsed.aux_loss), e, rtol=1e-3)
  np.testing.assert_allclose(float(collapsed.metrics["max_load"]), e)


# ---------------------------------------------------------------- expert parallel == one device

MODES = {"expert": ((8,), ("data",), 8), "expert_axis": ((2, 4), ("data", "expert"), 4)}


def tiny_moe(preset, ici, axes, *more):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=32",
      "model.num_heads=4", "model.d_ff=64", "model.max_len=16",
      "model.moe.d_ff=64", "model.moe.capacity_factor=1.0", "data.seq_len=16",
      "train.global_batch=8", "data.source='synthetic'", f"sharding.preset={preset!r}",
      f"mesh.ici={ici!r}", f"mesh.axes={axes!r}", *more])
  return configs.build(cfg)


def one_device_run(exp):
  """(params, batch, loss, grads, metrics), all on host, of `exp` on one device: params from
  init with key 0, a batch of 8 random rows of 16 tokens."""
  setup = setup_for(exp, jax.devices()[:1])
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  return jax.device_get(params), batch, float(loss), jax.device_get(grads), jax.device_get(metrics)


def sharded_run(mode, exp, reference):
  """(mode, expert shards, setup, loss, grads, metrics, compiled) of `exp` (built for MODES[mode])
  on its mesh, from the params and batch of `reference` (one_device_run's)."""
  setup = setup_for(exp)
  params_host, batch, *_ = reference
  (loss, grads, metrics), compiled = loss_and_grads(setup, params_host, batch)
  return mode, MODES[mode][2], setup, float(loss), jax.device_get(grads), metrics, compiled


@pytest.fixture(scope="module")
def reference():
  return one_device_run(tiny_moe("dp", (1,), ("data",)))


@pytest.fixture(scope="module", params=list(MODES))
def sharded(request, reference):
  ici, axes, _ = MODES[request.param]
  return sharded_run(request.param, tiny_moe(request.param, ici, axes), reference)


def test_expert_parallel_equals_single_device(sharded, reference):
  mode, _, _, loss, grads, metrics, _ = sharded
  _, _, ref_loss, ref_grads, ref_metrics = reference
  assert ref_metrics["moe/top1_overflow"] > 0      # capacity 4 of 16 tokens: some drop
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for k in ref_metrics:
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
  flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat) > 10
  for g, r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=mode)


def test_eval_loss_is_the_cross_entropy_of_deterministic_routing(reference):
  """Eval reports the cross entropy alone (no balance loss), with every token sent to both
  its top-2 experts: no random draw, so the gating seed plays no part."""
  from shardax.sharding import use_rules
  from shardax.trainer import step as step_lib
  params, batch, train_loss, _, metrics = reference

  def loss(fn, *more):
    setup = setup_for(tiny_moe("dp", (1,), ("data",), *more), jax.devices()[:1])
    with jax.set_mesh(setup.mesh), use_rules(setup.rules):
      return jax.device_get(jax.jit(fn(setup))(params, jax.device_put(batch, setup.batch_sharding)))

  got, weight = map(float, loss(step_lib.eval_loss_fn))  # (mean per target, targets)
  assert weight == batch["targets"].size
  assert got == float(loss(step_lib.eval_loss_fn, "model.moe.seed=7")[0])
  # The training path's own cross entropy when routing is 'all' and no regularizer is on:
  _, all_metrics = loss(step_lib.loss_fn, "model.moe.second_expert='all'", "model.moe.aux_loss_weight=0.0")
  assert got == pytest.approx(float(all_metrics["ce_loss"]), rel=1e-6)
  # Training ('random' second expert, weighted balance loss) reports other numbers.
  assert abs(float(metrics["ce_loss"]) - got) > 1e-4 and train_loss > float(metrics["ce_loss"])


def test_compiled_step_has_all_to_alls_of_the_dispatched_tokens(sharded):
  mode, expert_shards, setup, *_, compiled = sharded
  a2a = [c for c in report.collectives(compiled.as_text()) if c.kind == "all-to-all"]
  # dispatch and combine, forward and backward: 4 all-to-alls inside the layer scan,
  # each over one expert group, each moving one device's [e, g, c, m] dispatched block.
  assert len(a2a) == 4, a2a
  assert {c.group_size for c in a2a} == {expert_shards}
  e, g, c, m = 8, 8, 4, 32
  assert all(x.bytes == e * g * c * m * 4 // 8 for x in a2a), a2a
  assert all("moe.py" in x.source for x in a2a)


def test_expert_weights_take_a_device_share(sharded):
  mode, expert_shards, setup, *_ = sharded
  rows = report.param_table(setup.abstract["params"], setup.shardings["params"], setup.param_axes)
  experts = [r for r in rows if "expert" in r.logical_axes]
  assert len(experts) == 3
  for r in experts:
    assert r.bytes_per_device * expert_shards == r.bytes_total, r


# ---------------------------------------------------------------- training and the 1T config

def test_moe_tiny_trains_and_checkpoints(tmp_path):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=32",
      "model.d_ff=64", "model.max_len=32", "model.moe.d_ff=64",
      "data.seq_len=32", "train.global_batch=8", "train.steps=6", "train.eval_every=6",
      "train.eval_batches=2", "train.log_every=3", "checkpoint.every=6",
      "optimizer.warmup_steps=1", "optimizer.learning_rate=1e-2", "mesh.ici=(8, 1)"])
  summary = loop.train(configs.build(cfg), str(tmp_path))
  evals = summary["eval_losses"]
  assert sorted(evals) == [0, 6] and evals[6] < evals[0] - 0.5, evals
  assert os.listdir(tmp_path / "checkpoints") == ["6"]
  logged = [json.loads(l) for l in open(tmp_path / "metrics.jsonl") if '"loss"' in l]
  for key in ("ce_loss", "moe/aux_loss", "moe/dropped_fraction", "moe/max_load"):
    assert key in logged[-1], key
  assert 0.9 < logged[-1]["moe/aux_loss"] < 8


def test_gshard_1t_builds_abstractly_with_one_expert_per_core():
  exp = configs.build(configs.get("moe.gshard_1t"))
  assert 0.95e12 < exp.model.param_count() < 1.1e12
  setup = state_lib.create(exp, jax.sharding.AbstractMesh(
      (2048, 1), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2))
  assert state_lib.count_params(setup) == exp.model.param_count()
  wo = setup.abstract["params"]["layers"]["blocks"]["moe_block"]["moe"]["wo"]
  assert wo.shape == (20, 2048, 8192, 1024)
  assert wo.sharding.shard_shape(wo.shape) == (20, 1, 8192, 1024)


def test_moe_flops_match_a_hand_count():
  """A 4-layer MoE LM (MoE FFN in layers 2 and 4), counted matmul by matmul, per token."""
  from shardax.configs.schema import TransformerConfig
  from shardax.perf import flops
  d, heads, ff, vocab, seq, experts, expert_ff = 64, 4, 256, 256, 32, 16, 128
  moe = TransformerConfig(num_layers=4, d_model=d, num_heads=heads, d_ff=ff, vocab_size=vocab,
                          moe=MoEConfig(num_experts=experts, d_ff=expert_ff, every=2))
  # Forward, 2 FLOPs per multiply-add:
  attention = 2 * 4 * d * d + 2 * 2 * seq * d / 2      # q, k, v, out (d x d each); causal scores
  dense_ffn = 2 * 3 * d * ff                           # gate, up, down
  moe_ffn = 2 * d * experts + 2 * (2 * 3 * d * expert_ff)   # router + the 2 chosen experts' FFNs
  head = 2 * d * vocab
  forward = 4 * attention + 2 * dense_ffn + 2 * moe_ffn + head
  assert flops.per_token(moe, seq) == 3 * forward   # backward = 2 x forward


def test_moe_flops_agree_with_the_compiler():
  """The compiler's FLOP count of the forward pass (one device, layers unrolled, every
  second expert dispatched, E x C = 2S slots so the experts process exactly 2 tokens' worth
  per token) against the formula's forward third. The compiler also counts the dispatch and
  combine einsums (2 x 2GSECd per MoE layer), the masked half of the attention scores, the
  embedding lookup (a one-hot matmul at this vocab size, layers/embedding.py: 2 x tokens x
  vocab x d_model) and elementwise work: so it must lie within +10% of their sum. Doubling the expert d_ff must
  add what 2 experts x 3 matrices predict (elementwise activations aside: within 5%)."""
  from shardax.perf import flops
  from shardax.sharding import use_rules
  from shardax.trainer import step as step_lib
  counted = {}
  for h in (64, 128):
    exp = tiny_moe("dp", (1,), ("data",), "model.scan_layers=False",
                   "model.remat='none'", "model.moe.second_expert='all'", f"model.moe.d_ff={h}")
    setup = setup_for(exp, jax.devices()[:1])
    with jax.set_mesh(setup.mesh), use_rules(setup.rules):
      compiled = jax.jit(lambda p, b: step_lib.loss_fn(setup)(p, b)[0]).lower(
          setup.abstract["params"], step_lib.abstract_batch(setup)).compile()
    cost = compiled.cost_analysis()
    counted[h] = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    m, t, s, b = exp.model.moe, exp.model, exp.data.seq_len, exp.train.global_batch
    groups, c = b * s // s, m.capacity(s)
    assert m.num_experts * c == 2 * s
    formula = flops.per_token(exp.model, s) * s * b / 3
    masked_half = 4 * t.num_layers * s * t.num_heads * t.dim_per_head / 2 * b * s
    dispatch_combine = exp.model.num_moe_layers * 2 * 2 * groups * s * m.num_experts * c * t.d_model
    lookup = 2 * b * s * exp.model.vocab_size * t.d_model
    ratio = counted[h] / (formula + masked_half + dispatch_combine + lookup)
    assert 1.0 <= ratio <= 1.10, (h, counted[h], formula, ratio)
  added = exp.model.num_moe_layers * 2 * (2 * 3 * t.d_model * 64) * b * s
  assert counted[128] - counted[64] == pytest.approx(added, rel=0.05)


def test_bad_moe_config_names_the_field():
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, ["model.moe.every=3"])
  with pytest.raises(configs.ConfigError, match="model.num_layers=4 .* model.moe.every=3"):
    configs.build(cfg)
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, ["model.moe.second_expert='top'"])
  with pytest.raises(configs.ConfigError, match="model.moe.second_expert='top'"):
    configs.build(cfg)
