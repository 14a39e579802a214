"""Optimizer numerics: per-parameter options by name, layer stacks, master weights, Adafactor.

The equivalence tests start every variant from the same weights (the scanned model's
init, restacked into the variant's layout) and feed the same batches, so any
difference in the params after N real train steps is the optimizer's doing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs, pipeline
from shardax.configs.schema import ConfigError, OptimizerConfig
from shardax.sharding import use_rules
from shardax.trainer import optimizer
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from shardax.trainer.data import inputs
from meshtools import setup_for

L, BATCH, SEQ = 4, 8, 16


def experiment(*overrides):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      f"model.num_layers={L}", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
      f"model.max_len={SEQ}", f"data.seq_len={SEQ}", f"train.global_batch={BATCH}",
      "data.source='synthetic'", "train.steps=20", "mesh.ici=(1, 1)",
      "optimizer.warmup_steps=2", "optimizer.learning_rate=1e-2", "optimizer.weight_decay=0.5",
      *overrides])
  return configs.build(cfg)


def synthetic_batches(n, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 256, size=(n, BATCH, SEQ + 1)).astype(np.int32)
  return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def train(setup, params, batches):
  """(final state on host, per-step losses): real jitted train steps from `params`."""
  params = jax.device_put(params, setup.shardings["params"])
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, setup.exp.sharding.allow_uneven):
    opt_state = jax.jit(setup.tx.init, out_shardings=setup.shardings["opt_state"])(params)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state}
    step = step_lib.train_step_fn(setup)
    losses = []
    for batch in batches:
      state, metrics = step(state, jax.device_put(batch, setup.batch_sharding))
      losses.append(metrics["loss"])
    return jax.device_get(state), np.asarray(jax.device_get(losses))


def init_params(setup):
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    return jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])


# --- the rule ------------------------------------------------------------------------------

def test_param_rule_decides_by_name_and_axes_not_rank():
  cfg = OptimizerConfig()
  rule = lambda path, axes, c=cfg: optimizer.param_rule(path, axes, c)
  assert not rule("final_norm/scale", ("embed",)).decay
  assert not rule("layers/blocks/attn_norm/scale", ("layers", "embed")).decay
  assert not rule("layers/blocks/attn_norm/bias", ("stage", "repeat", "layers", "embed")).decay
  assert rule("layers/blocks/mlp/up/kernel", ("layers", "embed", "mlp")).decay
  assert rule("embed/embedding", ("vocab", "embed")).decay
  no_embed = OptimizerConfig(decay_embeddings=False)
  assert not rule("embed/embedding", ("vocab", "embed"), no_embed).decay
  assert rule("head/kernel", ("embed", "vocab"), no_embed).decay
  assert [rule("x/kernel", a).stack_dims for a in
          [("embed", "mlp"), ("layers", "embed", "mlp"), ("stage", "layers", "embed"),
           ("stage", "repeat", "layers", "embed")]] == [0, 1, 2, 3]


def test_bad_optimizer_fields_name_the_fix():
  with pytest.raises(ConfigError, match="optimizer.name='sgd'.*adamw"):
    OptimizerConfig(name="sgd")
  with pytest.raises(ConfigError, match="optimizer.master_dtype='fp32'.*float32"):
    OptimizerConfig(master_dtype="fp32")


# --- scanned, unscanned and pipelined twins take the same steps -------------------------

LAYOUTS = {
    "unscanned": ("model.scan_layers=False",),
    "pipelined": ("model.pipeline.stages=2", "model.pipeline.microbatches=2",
                  "mesh.axes=('stage', 'data')", "mesh.ici=(2, 1)", "sharding.preset='pp_dp'"),
    "circular": ("model.pipeline.stages=2", "model.pipeline.microbatches=2",
                 "model.pipeline.circular_repeats=2",
                 "mesh.axes=('stage', 'data')", "mesh.ici=(2, 1)", "sharding.preset='pp_dp'"),
}


def to_layout(params, layout, exp):
  """Scanned-layout params ([L, ...] stacks) -> the layout's, and `from_layout` back."""
  blocks = params["layers"]["blocks"]
  if layout == "unscanned":
    blocks = {i: jax.tree.map(lambda a: a[i], blocks) for i in range(L)}
  elif layout in ("pipelined", "circular"):
    p = exp.model.pipeline
    blocks = pipeline.stage_params(blocks, p.stages, p.circular_repeats)
  return dict(params, layers={"blocks": blocks})


def from_layout(params, layout, exp):
  blocks = params["layers"]["blocks"]
  if layout == "unscanned":
    blocks = jax.tree.map(lambda *a: np.stack(a), *[blocks[i] for i in range(L)])
  elif layout in ("pipelined", "circular"):
    blocks = pipeline.unstage_params(blocks, exp.model.pipeline.circular_repeats)
  return dict(params, layers={"blocks": jax.device_get(blocks)})


@pytest.fixture(scope="module", params=["adamw", "adafactor"])
def scanned_run(request):
  # factored_min_dim=16: the 32 x 64 test matrices get factored moments.
  opt = (f"optimizer.name={request.param!r}", "optimizer.factored_min_dim=16")
  setup = setup_for(experiment(*opt), jax.devices()[:1])
  params = init_params(setup)
  batches = synthetic_batches(20)
  state, _ = train(setup, params, batches)
  return opt, params, batches, state["params"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layer_layout_does_not_change_the_optimizer_steps(scanned_run, layout):
  opt, params, batches, want = scanned_run
  exp = experiment(*opt, *LAYOUTS[layout])
  setup = setup_for(exp, jax.devices()[:exp.mesh.ici[0] * exp.mesh.ici[1]])
  state, _ = train(setup, to_layout(params, layout, exp), batches)
  got = from_layout(state["params"], layout, exp)
  # Weight decay would pull the stacked norm scales off 1 at (lr x 0.5) per step.
  scales = want["layers"]["blocks"]["attn_norm"]["scale"]
  assert np.abs(scales - 1).max() > 1e-3   # they did train
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=f"{layout} {opt[0]} {path}")


# --- master weights --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stdlib_batches(tmp_path_factory):
  """40 lm.tiny-style training batches of the stdlib corpus (prepared in a temp dir, ~3 s)."""
  exp = experiment("data.source='stdlib'", f"data.data_dir={str(tmp_path_factory.mktemp('data'))!r}")
  data = inputs.Batches(exp.data, "train", BATCH, None, seed=0)
  return exp.data.data_dir, [jax.device_get(next(data)) for _ in range(40)]


def stdlib_curve(stdlib_batches, *overrides):
  data_dir, batches = stdlib_batches
  exp = experiment("data.source='stdlib'", f"data.data_dir={data_dir!r}", "train.steps=40",
                   "optimizer.warmup_steps=5", "optimizer.learning_rate=3e-3",
                   "optimizer.weight_decay=0.1", *overrides)
  setup = setup_for(exp, jax.devices()[:1])
  # Every run starts from the same (bf16-representable) weights.
  params = jax.tree.map(lambda a, p: a.astype(p.dtype), start_params(data_dir), setup.abstract["params"])
  return train(setup, params, batches)[1]


@functools.cache
def start_params(data_dir):
  setup = setup_for(experiment(f"data.data_dir={data_dir!r}", "model.param_dtype='bfloat16'"),
                    jax.devices()[:1])
  return init_params(setup)


def test_fp32_master_tracks_the_fp32_loss_curve_closer_than_bf16(stdlib_batches):
  fp32 = stdlib_curve(stdlib_batches)
  bf16 = stdlib_curve(stdlib_batches, "model.param_dtype='bfloat16'")
  master = stdlib_curve(stdlib_batches, "model.param_dtype='bfloat16'", "optimizer.master_dtype='float32'")
  gap_bf16, gap_master = np.abs(bf16 - fp32).mean(), np.abs(master - fp32).mean()
  print(f"\nlm.tiny (shrunk) 40 steps, mean |loss - fp32 loss|: bf16 params {gap_bf16:.4f}, "
        f"bf16 params + fp32 master {gap_master:.4f}; fp32 loss {fp32[0]:.3f} -> {fp32[-1]:.3f}")
  assert fp32[-1] < fp32[0] - 1.0
  assert gap_master < 0.5 * gap_bf16


def test_master_copy_is_fp32_and_sharded_like_the_params():
  exp = experiment("model.param_dtype='bfloat16'", "optimizer.master_dtype='float32'",
                   "mesh.ici=(2, 4)", "sharding.preset='2d'")
  setup = setup_for(exp)
  master_sh = setup.shardings["opt_state"].master
  master_abs = setup.abstract["opt_state"].master
  param_sh, params_abs = setup.shardings["params"], setup.abstract["params"]
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    compiled = step_lib.compile_train_step(setup)
  # The compiled step takes and returns the master copy with the params' shardings.
  state_in = compiled.input_shardings[0][0]
  state_out = compiled.output_shardings[0]
  for sh in (master_sh, state_in["opt_state"].master, state_out["opt_state"].master):
    for s, p, a in zip(jax.tree.leaves(sh), jax.tree.leaves(param_sh), jax.tree.leaves(params_abs),
                       strict=True):
      assert s.is_equivalent_to(p, a.ndim), (s, p)
  assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(param_sh))
  for m, p in zip(jax.tree.leaves(master_abs), jax.tree.leaves(params_abs), strict=True):
    assert (m.dtype, p.dtype) == (jnp.float32, jnp.bfloat16) and m.shape == p.shape
  # Adam's moments live on the master copy, so they are float32 as well.
  mu = setup.abstract["opt_state"].inner[1][0].mu
  assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(jnp.float32)}
  # No copy when the params already have the master dtype.
  plain = setup_for(experiment("optimizer.master_dtype='float32'"), jax.devices()[:1])
  assert not isinstance(plain.abstract["opt_state"], optimizer.MasterState)


# --- Adafactor -------------------------------------------------------------------------------

def test_adafactor_trains_lm_tiny(stdlib_batches):
  losses = stdlib_curve(stdlib_batches, "optimizer.name='adafactor'", "optimizer.factored_min_dim=16",
                        "optimizer.learning_rate=1e-2")
  print(f"\nAdafactor, lm.tiny (shrunk) 40 steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  assert np.all(np.isfinite(losses)) and losses[-5:].mean() < losses[0] - 1.5


def adafactor_steps(params, axes, grads):
  """(the updates of param `w` at each of the steps `grads`, stacked; the last state) of a
  factored Adafactor without clipping, warm-up or decay, so a weight's steps depend on it alone."""
  cfg = OptimizerConfig(name="adafactor", factored_min_dim=4, clip_norm=None, warmup_steps=0,
                        weight_decay=0.0)
  tx = optimizer.make(cfg, 10, params, axes)
  state, out = tx.init(params), []
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state, params)
    out.append(updates["w"])
  return np.stack(out), state


def test_adafactor_sees_one_layer_of_a_stack_at_a_time():
  """A [layers, embed, mlp] stack takes the steps its layers would take one by one, even
  when the layers' scales differ (Adafactor's clipping and step size use a weight's RMS)."""
  rng = np.random.default_rng(0)
  scales = np.array([1.0, 30.0, 0.01], np.float32)[:, None, None]
  params = {"w": rng.normal(size=(3, 8, 16)).astype(np.float32) * scales}
  grads = [{"w": rng.normal(size=(3, 8, 16)).astype(np.float32) * scales} for _ in range(3)]
  stacked, _ = adafactor_steps(params, {"w": ("layers", "embed", "mlp")}, grads)
  for i in range(3):
    alone, _ = adafactor_steps({"w": params["w"][i]}, {"w": ("embed", "mlp")}, [{"w": g["w"][i]} for g in grads])
    np.testing.assert_allclose(stacked[:, i], alone, rtol=1e-5, atol=1e-9, err_msg=f"layer {i}")


def factored_moments(setup):
  """[(param path, v_row or v_col leaf)] of the Adafactor state (abstract, with shardings)."""
  per_param = setup.abstract["opt_state"][1]   # after clip_by_global_norm
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(per_param)[0]:
    name = jax.tree_util.keystr(path)
    if (".v_row" in name or ".v_col" in name) and leaf.shape[-1] > 1:
      out.append((name, leaf))
  return out


def test_factored_moments_are_split_along_the_dims_they_keep():
  setup = setup_for(experiment("optimizer.name='adafactor'", "optimizer.factored_min_dim=8",
                               "mesh.ici=(8, 1)", "sharding.preset='fsdp'"))
  moments = factored_moments(setup)
  # Every matrix is factored (min dim 8): embedding, q/k/v/out projections, 3 MLP matrices.
  assert len(moments) == 2 * 8
  d_model = setup.exp.model.d_model   # the only dim of size 32: `embed`, which FSDP splits 8 ways
  split = 0
  for name, leaf in moments:
    local = np.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    total = np.prod(leaf.shape) * leaf.dtype.itemsize
    assert local == (total // 8 if d_model in leaf.shape else total), (name, leaf.shape, leaf.sharding)
    split += d_model in leaf.shape
  assert split >= 8
  # The real arrays agree with the plan.
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    state = state_lib.init_fn(setup)(jax.random.key(0))
  real = dict(factored_moments_of(state["opt_state"]))
  for name, leaf in moments:
    assert real[name].addressable_shards[0].data.shape == leaf.sharding.shard_shape(leaf.shape)


def factored_moments_of(opt_state):
  return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(opt_state[1])[0]
          if any(k in jax.tree_util.keystr(p) for k in (".v_row", ".v_col"))]


@pytest.mark.parametrize("ici,preset", [((8, 1), "fsdp"), ((2, 4), "2d")])
def test_sharded_adafactor_steps_equal_single_device(ici, preset):
  opt = ("optimizer.name='adafactor'", "optimizer.factored_min_dim=16", "train.steps=5")
  single = setup_for(experiment(*opt), jax.devices()[:1])
  params, batches = init_params(single), synthetic_batches(5, seed=1)
  want, want_losses = train(single, params, batches)
  sharded = setup_for(experiment(*opt, f"mesh.ici={ici!r}", f"sharding.preset={preset!r}"))
  got, got_losses = train(sharded, params, batches)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# --- z-loss ----------------------------------------------------------------------------------

def test_z_loss_adds_the_squared_log_normalizer_and_reports_it():
  on = setup_for(experiment("model.z_loss=1e-2"), jax.devices()[:1])
  off = setup_for(experiment(), jax.devices()[:1])
  params, batch = init_params(on), synthetic_batches(1)[0]
  with jax.set_mesh(on.mesh), use_rules(on.rules):
    loss, metrics = jax.jit(step_lib.loss_fn(on))(params, batch)
    ce, off_metrics = jax.jit(step_lib.loss_fn(off))(params, batch)
    logits = jax.jit(lambda p, x: on.model(p)(x))(params, batch["inputs"])
  z = np.mean(np.square(jax.nn.logsumexp(np.asarray(logits, np.float64), axis=-1)))
  assert set(off_metrics) == {"loss_weight"} and z > 1.0   # no z-loss metrics when it is off
  np.testing.assert_allclose(metrics["z_loss"], z, rtol=1e-5)
  np.testing.assert_allclose(metrics["ce_loss"], ce, rtol=1e-6)
  np.testing.assert_allclose(loss, ce + 1e-2 * z, rtol=1e-6)
  with pytest.raises(ConfigError, match="model.z_loss=-1"):
    experiment("model.z_loss=-1.0")


def test_adafactor_factors_each_expert_matrix_on_its_own():
  """MoE expert weights [layers, expert, embed, mlp]: every expert's [embed, mlp] matrix is
  one weight to Adafactor (its steps are the ones it would take alone), and the factored
  moments keep the expert dim, so expert parallelism splits them (moe.gshard_1t)."""
  rng = np.random.default_rng(0)
  scales = np.array([1.0, 30.0, 0.01], np.float32)[None, :, None, None]
  params = {"w": rng.normal(size=(2, 3, 8, 16)).astype(np.float32) * scales}
  grads = [{"w": rng.normal(size=(2, 3, 8, 16)).astype(np.float32) * scales} for _ in range(3)]
  axes = {"w": ("layers", "expert", "embed", "mlp")}
  stacked, state = adafactor_steps(params, axes, grads)
  for layer in range(2):
    for e in range(3):
      alone, _ = adafactor_steps({"w": params["w"][layer, e]}, {"w": ("embed", "mlp")},
                                 [{"w": g["w"][layer, e]} for g in grads])
      np.testing.assert_allclose(stacked[:, layer, e], alone, rtol=1e-5, atol=1e-9,
                                 err_msg=f"layer {layer} expert {e}")
  moments = {}
  optimizer.map_state_axes(jax.eval_shape(lambda: state), params, axes,
                           lambda a, leaf: moments.setdefault(leaf.shape, a))
  assert moments[(2, 3, 8)] == ("layers", "expert", "embed")    # v_row: one per expert
  assert moments[(2, 3, 16)] == ("layers", "expert", "mlp")     # v_col
