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


@pytest.mark.parametrize("impl", ["ragged_dot", "tiled"])
@pytest.mark.parametrize("case", list(CASES))
def test_dropless_equals_a_per_token_loop(case, impl):
  """Both grouped matmuls: jax.lax.ragged_dot and the tiled one CPUs use."""
  cfg = dataclasses.replace(CASES[case], grouped_matmul=impl)
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


def test_last_gate_reports_how_much_the_kth_choice_counts():
  """'last_gate': the k-th chosen expert's share of the chosen scores, before any scale.
  Near 0 a top-k router has collapsed toward fewer experts (a softmax whose logits grew)."""
  logits = jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.25, 0.5, 0.25]], jnp.float32))
  two = routers.route(logits, top_k=2, gate_scale=2.0).metrics["last_gate"]
  np.testing.assert_allclose(two, (0.2 / 0.9 + 0.25 / 0.75) / 2, rtol=1e-5)
  np.testing.assert_allclose(routers.route(logits, top_k=1).metrics["last_gate"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(routers.route(logits, top_k=3, renormalize=False).metrics["last_gate"],
                             (0.1 + 0.25) / 2, rtol=1e-5)


def test_capacity_dispatch_rejects_routers_it_cannot_run():
  with pytest.raises(Exception, match="model.moe.dispatch='capacity' is GShard"):
    MoEConfig(top_k=4)
  with pytest.raises(Exception, match="model.moe.top_k=9"):
    MoEConfig(num_experts=8, top_k=9, dispatch="dropless")


# ---------------------------------------------------------------- expert parallel == one device

from shardax import configs  # noqa: E402
from shardax.sharding import report  # noqa: E402
from shardax.trainer import state as state_lib  # noqa: E402
from meshtools import loss_and_grads, setup_for  # noqa: E402
from test_moe import MODES, one_device_run, sharded_run  # noqa: E402

DROPLESS = ["model.moe.dispatch='dropless'", "model.moe.top_k=2", "model.moe.num_shared_experts=1",
            "model.moe.first_dense_layers=1", "model.num_layers=3", "model.moe.every=1"]


def tiny_dropless(preset, ici, axes, *more):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, [
      "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
      "model.max_len=16", "model.moe.d_ff=32", "data.seq_len=16", "train.global_batch=8",
      "data.source='synthetic'", f"sharding.preset={preset!r}", f"mesh.ici={ici!r}",
      f"mesh.axes={axes!r}", "model.moe.expert_buffer=4.0", *DROPLESS, *more])
  return configs.build(cfg)


@pytest.fixture(scope="module")
def reference_run():
  return one_device_run(tiny_dropless("dp", (1,), ("data",)))


@pytest.fixture(scope="module", params=list(MODES), name="sharded_run")
def sharded_run_fixture(request, reference_run):
  ici, axes, _ = MODES[request.param]
  return sharded_run(request.param, tiny_dropless(request.param, ici, axes), reference_run)


def test_dropless_expert_parallel_equals_single_device(sharded_run, reference_run):
  mode, _, _, loss, grads, metrics, _ = sharded_run
  _, _, ref_loss, ref_grads, ref_metrics = reference_run
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for k in ("ce_loss", "moe/aux_loss", "moe/max_load"):
    np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, err_msg=k)
  flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat) > 10
  for (path, g), r in zip(flat, ref_flat):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=f"{mode} {jax.tree_util.keystr(path)}")


def test_dropless_step_moves_tokens_by_all_to_all_not_weights(sharded_run):
  """Forward and backward of the 2 MoE layers (scanned: one body) each send the token
  copies out and back: 4 all-to-alls of rows and 4 of their expert ids... and no
  all-gather moves an expert weight (they stay split over the expert shards)."""
  mode, expert_shards, setup, *_, compiled = sharded_run
  hlo = compiled.as_text()
  colls = report.collectives(hlo)
  a2a = [c for c in colls if c.kind == "all-to-all"]
  assert a2a and {c.group_size for c in a2a} == {expert_shards}, a2a
  assert all("moe_dispatch.py" in c.source for c in a2a), a2a
  expert_bytes = {int(np.prod(a.shape[-3:])) * 4 for p, a in jax.tree.leaves_with_path(setup.abstract["params"])
                  if "wi_gate" in jax.tree_util.keystr(p) or "wo" in jax.tree_util.keystr(p)}
  gathers = [c for c in colls if c.kind == "all-gather"]
  assert not [c for c in gathers if c.bytes >= min(expert_bytes) // expert_shards], gathers


def test_train_step_writes_the_balance_bias_the_optimizer_leaves_alone():
  """Through the real train step (AdamW, lr 1e-2, weight decay): each step the bias moves
  by exactly +-rate per expert (the layer's next_bias written over the params), while
  the optimizer moves the router. Seen failing with the write-back removed (bias stays 0)."""
  from shardax.sharding import use_rules
  from shardax.trainer import step as step_lib
  rate = 0.125   # a power of two: the sums below are exact in float32
  exp = tiny_dropless("dp", (1,), ("data",), f"model.moe.bias_update_rate={rate}",
                      "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=0")
  setup = setup_for(exp, jax.devices()[:1])
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, setup.batch_sharding)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    state = state_lib.init_fn(setup)(jax.random.key(0))
    router0 = np.asarray(state["params"]["layers"]["blocks"]["moe_block"]["moe"]["router"]["kernel"])
    step = step_lib.train_step_fn(setup)
    biases = []
    for _ in range(2):
      state, metrics = step(state, batch)
      assert step_lib.STATE_UPDATES not in metrics
      biases.append(np.asarray(state["params"]["layers"]["blocks"]["moe_block"]["moe"]["balance_bias"]))
  first, second = biases
  assert first.shape == (2, 8)                        # [moe layers, experts]
  assert set(np.unique(first / rate)) <= {-1, 0, 1} and np.abs(first).max() == rate
  assert set(np.unique((second - first) / rate)) <= {-1, 0, 1}
  assert not np.array_equal(second, first)
  router = np.asarray(state["params"]["layers"]["blocks"]["moe_block"]["moe"]["router"]["kernel"])
  assert np.abs(router - router0).max() > 1e-3       # the router itself trains


def test_enough_expert_buffer_reports_no_overflow(sharded_run):
  """The control for the overflow test below: buffer 4x the fair share, finite loss, count 0."""
  *_, loss, _, metrics, _ = sharded_run
  assert np.isfinite(loss)
  assert float(metrics["moe/expert_buffer_overflow"]) == 0


def test_expert_buffer_overflow_poisons_the_step_and_the_loop_names_the_field(tmp_path):
  """Under expert parallelism (8 devices, preset `expert`) a buffer of 0.1x the fair share
  holds one token copy per destination of the 32 each device sends: the copies that do
  not fit are never silently dropped. The step's loss is NaN, its update is not applied,
  the count reaches the metrics, and `loop.train` stops with an error naming
  `model.moe.expert_buffer` (rather than skipping the step as a mere non-finite one).
  Seen failing with the NaN poisoning in `moe_dispatch.dropless` removed (finite loss,
  weights moved) and with the loop's check removed (the step skipped, no error)."""
  from shardax.sharding import use_rules
  from shardax.trainer import loop
  from shardax.trainer import step as step_lib
  exp = tiny_dropless("expert", (8,), ("data",), "model.moe.expert_buffer=0.1",
                      "train.steps=2", "train.log_every=1", "train.eval_every=100",
                      "train.eval_batches=1", "checkpoint.enabled=False")
  setup = setup_for(exp)
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, setup.batch_sharding)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    state = state_lib.init_fn(setup)(jax.random.key(0))
    before = jax.device_get(state["params"])
    state, metrics = step_lib.train_step_fn(setup)(state, batch)
  metrics = jax.device_get(metrics)
  assert float(metrics["moe/expert_buffer_overflow"]) > 0
  assert np.isnan(metrics["loss"]) and not metrics["finite"]
  for (path, new), old in zip(jax.tree.leaves_with_path(jax.device_get(state["params"])), jax.tree.leaves(before)):
    np.testing.assert_array_equal(new, old, err_msg=jax.tree_util.keystr(path))
  stub = {"eval_loss": 0.0, "eval_weight": 1.0, "eval_batches": 1}   # the step-0 eval would raise first
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(loop, "_eval_sources", lambda *a: stub)
    with pytest.raises(loop.NonFiniteError, match=r"step 1: .* did not fit .*model\.moe\.expert_buffer"):
      loop.train(exp, str(tmp_path))
  # Evaluation raises the same error (its loss would be NaN): seen failing before the eval
  # passed the count on (no error, eval_loss nan).
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    with pytest.raises(loop.NonFiniteError, match=r"eval \(1 batches\): .* did not fit .*model\.moe\.expert_buffer"):
      loop._eval_sources(loop.eval_sums_fn(setup), state["params"], setup)


def test_default_expert_buffer_holds_the_worst_routing(reference_run):
  """expert_buffer unset (None): the no-overflow bound. A zero router sends every token to
  experts 0 and 1 (ties, stable order), i.e. each device sends all its T copies of the
  first choice to shard 0 and of the second to shard 1: 4 fair shares (2T / (2T/8)) per
  destination on 8 expert shards. At the default the step equals one device (nothing
  dropped, count 0); at 2.0 (the old default) the same step overflows. Seen failing with
  the bound replaced by 2.0 (`assert 128.0 == 0`: 128 copies per MoE layer overflowed)."""
  params, batch, *_ = reference_run
  params = jax.tree_util.tree_map_with_path(
      lambda p, v: np.zeros_like(v) if "router" in jax.tree_util.keystr(p) else v, params)
  one = setup_for(tiny_dropless("dp", (1,), ("data",)), jax.devices()[:1])
  (ref_loss, ref_grads, _), _ = loss_and_grads(one, params, batch)
  runs = {}
  for buffer in (None, 2.0):
    setup = setup_for(tiny_dropless("expert", (8,), ("data",), f"model.moe.expert_buffer={buffer}"))
    runs[buffer] = loss_and_grads(setup, params, batch)[0]
  loss, grads, metrics = runs[None]
  assert float(metrics["moe/expert_buffer_overflow"]) == 0
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  assert float(runs[2.0][2]["moe/expert_buffer_overflow"]) > 0 and np.isnan(runs[2.0][0])


def test_overflow_drop_leaves_the_copies_out_and_counts_them(reference_run):
  """expert_overflow='drop' at 2.0 with the zero router (above: 4 fair shares per
  destination): half of each device's copies travel, half are dropped, so
  each MoE layer drops half the copies it routes (moe/dropped_copies_count against
  moe/routed_copies_count, per layer); the step stays finite (nothing poisoned, no
  overflow count for the loop to raise on) and its loss is not the no-overflow step's (the
  dropped copies got no expert output)."""
  params, batch, *_ = reference_run
  params = jax.tree_util.tree_map_with_path(
      lambda p, v: np.zeros_like(v) if "router" in jax.tree_util.keystr(p) else v, params)
  losses = {}
  for buffer in (None, 2.0):
    setup = setup_for(tiny_dropless("expert", (8,), ("data",), f"model.moe.expert_buffer={buffer}",
                                    "model.moe.expert_overflow='drop'"))
    loss, grads, metrics = loss_and_grads(setup, params, batch)[0]
    assert np.isfinite(loss) and all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert "moe/expert_buffer_overflow" not in metrics
    losses[buffer] = float(loss)
    dropped, routed = metrics["moe/dropped_copies_count"], metrics["moe/routed_copies_count"]
    assert dropped.shape == routed.shape == (setup.exp.model.num_moe_layers,)
    np.testing.assert_array_equal(dropped / routed, 0.5 if buffer else 0.0)
  assert abs(losses[2.0] - losses[None]) > 1e-4, losses


def test_dropless_under_context_parallelism_splits_the_sequence(reference_run):
  """Preset `dp_cp` on (data 2, context 4), experts replicated: each device routes and runs
  the experts of its own quarter of the sequence. Equal to one device (loss, every
  gradient), and the compiled step all-gathers nothing but attention's K/V
  (context_parallel.py): before, the dispatch's shard_map (tokens P(batch)) gathered the
  whole sequence onto every context device (all-gathers from moe_dispatch.py, routers.py
  and norm.py), each repeating the whole sequence's expert work."""
  params, batch, ref_loss, ref_grads, _ = reference_run
  setup = setup_for(tiny_dropless("dp_cp", (2, 4), ("data", "context")))
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  gathers = [c for c in report.collectives(compiled.as_text())
             if c.kind == "all-gather" and "context_parallel.py" not in c.source]
  assert not gathers, gathers


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's semantics from all_gather and scatters (XLA:CPU has no
  ragged-all-to-all): sender s puts operand[input_offsets[j]:+send_sizes[j]] into device
  j's output at output_offsets[j]."""
  ops, ins, sizes, outs = (jax.lax.all_gather(v, axis_name) for v in
                           (operand, input_offsets, send_sizes, output_offsets))
  me = jax.lax.axis_index(axis_name)
  r = jnp.arange(operand.shape[0])
  for s in range(ops.shape[0]):
    dst = jnp.where(r < sizes[s, me], outs[s, me] + r, output.shape[0])
    output = output.at[dst].set(ops[s][jnp.minimum(ins[s, me] + r, operand.shape[0] - 1)], mode="drop")
  return output


@pytest.mark.parametrize("buffer", [None, 4.0])
def test_ragged_exchange_equals_one_device(reference_run, monkeypatch, buffer):
  """The `ragged_all_to_all` exchange's offsets, sizes and return path (the TPU/GPU default),
  with the collective itself emulated (above) since XLA:CPU cannot run it: on 8 expert
  shards it equals one device, as the padded exchange does (test above). That the real
  op compiles, with the shapes the buffer gives, is checked on a TPU topology in
  tests/test_moe_exchange.py."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  params, batch, ref_loss, ref_grads, _ = reference_run
  setup = setup_for(tiny_dropless("expert", (8,), ("data",), "model.moe.expert_exchange='ragged'",
                                  f"model.moe.expert_buffer={buffer}"))
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  assert float(metrics["moe/expert_buffer_overflow"]) == 0
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow   # Pallas' interpreter on CPU: ~9 s
def test_megablox_grouped_ffn_equals_ragged_dot_with_its_gradients():
  """megablox's gmm/tgmm kernels (grouped_matmul='megablox') leave rows outside every group
  unwritten: here an empty group, a buffer longer than the groups (rows 180..199) and rows
  padded to a whole tile. Seen failing (NaN input gradient) without the selects that keep
  those rows out."""
  from shardax.layers import moe_dispatch as md
  rng = np.random.default_rng(0)
  r, m, h, e = 200, 128, 256, 4
  xs = jnp.asarray(rng.normal(size=(r, m)), jnp.float32)
  sizes = jnp.array([50, 0, 70, 60], jnp.int32)
  ws = [jnp.asarray(rng.normal(size=s) * 0.1, jnp.float32) for s in [(e, m, h), (e, m, h), (e, h, m)]]
  f = lambda impl: lambda xs, *w: jnp.sum(md.grouped_ffn(xs, sizes, *w, jax.nn.silu, impl) ** 2)
  want = jax.value_and_grad(f("ragged_dot"), argnums=(0, 1, 2, 3))(xs, *ws)
  got = jax.value_and_grad(f("megablox"), argnums=(0, 1, 2, 3))(xs, *ws)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


FSDP_OVER_TWO_AXES = ("sharding.rules=(('batch', ('data', 'fsdp')), ('embed', ('data', 'fsdp')))",)


@pytest.mark.parametrize("preset, ici, axes, more", [
    ("fsdp", (8,), ("data",), ()),
    (None, (2, 4), ("data", "fsdp"), FSDP_OVER_TWO_AXES)], ids=["one_axis", "two_axes"])
def test_dropless_fsdp_gathers_expert_weights_and_reduce_scatters_their_gradients(
    reference_run, preset, ici, axes, more):
  """moe.mixtral_8x7b's layout on 8 devices: no expert parallelism, every expert weight
  FSDP-split over `data` (preset fsdp), or over two mesh axes (gathered one axis at a time).
  Equal to one device (loss, every gradient), and the expert weights' gradients leave by
  reduce-scatter, one per weight and mesh axis: no all-reduce as large as an expert
  weight's shard. Before, the weights entered the dispatch's shard_map whole, and each
  layer's backward all-reduced every expert weight's full gradient."""
  params, batch, ref_loss, ref_grads, _ = reference_run
  setup = setup_for(tiny_dropless(preset, ici, axes, *more))
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  # XLA:CPU leaves the dense layers' gradients as all-reduces (the TPU compiler makes them
  # reduce-scatters: tests/test_moe_exchange.py), so here only the dispatch's are checked.
  colls = report.collectives(compiled.as_text())
  expert_shard = min(int(np.prod(a.shape[-3:])) * 4 // 8 for p, a in
                     jax.tree.leaves_with_path(setup.abstract["params"]) if "wi_gate" in jax.tree_util.keystr(p))
  summed = [c for c in colls if c.kind == "all-reduce" and "shard_map" in c.op_name and c.bytes >= expert_shard]
  assert not summed, summed
  scattered = [c for c in colls if c.kind == "reduce-scatter" and "moe_dispatch.py" in c.source]
  # 3 weights x mesh axes, each run by 2 layers
  assert len(scattered) == 3 * len(axes) and all(c.executions == 2 for c in scattered), scattered


def test_moe_matmuls_remat_keeps_the_expert_matmuls_out_of_the_recompute():
  """remat='moe_matmuls' saves every expert matmul's output ('expert_matmul', 'expert_down'): the backward
  of a checkpointed dropless FFN then runs 3 fewer matmuls than under 'full' (the forward's
  gate, up and down are not recomputed), with the same gradients. (The tiled CPU path's
  einsums stand in for megablox's kernels, which 'dots' cannot save.)"""
  from shardax.layers import REMAT_POLICIES
  from shardax.layers.moe_dispatch import dropless_local
  from test_layers import dot_operand_dtypes
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(24, 16)), jnp.float32)
  index = jnp.asarray(rng.integers(0, 4, size=(24, 2)), jnp.int32)
  gates = jnp.asarray(rng.uniform(size=(24, 2)), jnp.float32)
  weights = tuple(jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((4, 16, 8), (4, 16, 8), (4, 8, 16)))
  loss = lambda w, x: jnp.sum(dropless_local(x, index, gates, w, jax.nn.silu, "tiled") ** 2)
  grads, dots = {}, {}
  for remat in ("full", "moe_matmuls"):
    f = jax.grad(jax.checkpoint(loss, policy=REMAT_POLICIES[remat]), argnums=(0, 1))
    grads[remat] = f(weights, x)
    dots[remat] = len(dot_operand_dtypes(jax.make_jaxpr(f)(weights, x).jaxpr))
  assert dots["moe_matmuls"] == dots["full"] - 3, dots
  for a, b in zip(jax.tree.leaves(grads["moe_matmuls"]), jax.tree.leaves(grads["full"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
