"""Pipeline parallelism (shardax.pipeline): same numbers as the unpipelined stack, 1/S weights per
device, a collective-permute between stages, and a pipelined experiment that trains and resumes.

The reference is the unpipelined 8-layer LM on one device; each pipelined case gets
the same weights restacked into its stage layout, and its gradients are restacked
back before comparing. Cases cover S in {2, 4}, M in {S, 2S}, R in {1, 2} and the
nested (stage=2, data=2, model=2) mesh.
"""

import collections
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax import configs, models, pipeline
from shardax.configs.schema import ConfigError
from shardax.perf.hlo import groups as replica_groups
from shardax.sharding import report, use_rules
from shardax.trainer import loop
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from shardax.perf import costs as costs_lib
from meshtools import coordinates, equations, loss_and_grads, pairs, setup_for, tiny_lm

L, BATCH = 8, 16
# name: (stages, microbatches, repeats, mesh ici, mesh axes, preset, *more overrides)
CASES = {
    "S2_M2_R1_stage2xdata4": (2, 2, 1, (2, 4), ("stage", "data"), "pp_dp"),
    "S2_M4_R2_stage2xdata2xmodel2": (2, 4, 2, (2, 2, 2), ("stage", "data", "model"), "pp_tp"),
    "S4_M8_R1_stage4xdata2": (4, 8, 1, (4, 2), ("stage", "data"), "pp_dp"),
    "S4_M4_R2_stage4xdata2_2d": (4, 4, 2, (4, 2, 1), ("stage", "data", "model"), "pp_2d"),
    "S2_M4_R2_delayed_stage2xdata2xmodel2": (2, 4, 2, (2, 2, 2), ("stage", "data", "model"), "pp_tp",
                                             "model.pipeline.delay_shift=True"),
    "S4_M4_R2_stage4xdata2_2d_grads_unconstrained": (4, 4, 2, (4, 2, 1), ("stage", "data", "model"), "pp_2d",
                                                     "model.pipeline.grads_in_layout=False"),
}


def experiment(stages=1, micro=1, repeats=1, ici=(1, 1), axes=("data", "model"), preset="dp", *extra):
  return tiny_lm(L, BATCH, stages, micro, repeats, ici, axes, preset, extra=extra)


@pytest.fixture(scope="module")
def reference():
  """Unpipelined params, batch, loss and grads on one device."""
  setup = setup_for(experiment(), jax.devices()[:1])
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  tokens = np.random.default_rng(0).integers(1, 256, size=(BATCH, 17)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  return jax.device_get(params), batch, float(loss), jax.device_get(grads)


@pytest.fixture(scope="module", params=list(CASES))
def pipelined(request, reference):
  stages, micro, repeats, ici, axes, preset, *extra = CASES[request.param]
  setup = setup_for(experiment(stages, micro, repeats, ici, axes, preset, *extra))
  ref_params, batch, _, _ = reference
  params = dict(ref_params, layers=pipeline.stage_params(ref_params["layers"], stages, repeats))
  params = jax.device_put(params, setup.shardings["params"])
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  grads = jax.device_get(grads)
  grads["layers"] = pipeline.unstage_params(grads["layers"], repeats)
  return request.param, setup, params, float(loss), grads, compiled


def test_loss_and_grads_equal_the_unpipelined_model(pipelined, reference):
  name, _, _, loss, grads, _ = pipelined
  _, _, ref_loss, ref_grads = reference
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=name)
  flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat) > 8
  for g, r in zip(flat, ref_flat):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=name)


def test_stages_talk_by_collective_permute(pipelined):
  """Every iteration each device sends its stage's microbatch to the next stage group (the
  buffer shift) and, backward, the cotangent back: collective-permutes between neighbouring
  stage groups inside the loop, one microbatch at most each, and no other collective in the
  loop crosses stage groups (no all-gather or all-reduce of the buffer).

  Read from the program's structure (pairs, sizes, trip counts), not op metadata: jax 0.11
  compiles the same permutes but leaves the forward one without metadata and names some
  backward ones after neighbouring ops (select_n, add_any) instead of the roll.
  """
  name, setup, _, _, _, compiled = pipelined
  stages, micro, repeats = CASES[name][:3]
  iterations = micro * repeats + stages - 1
  where = coordinates(setup.mesh.shape)
  stage, n = where.pop("stage"), setup.mesh.size
  microbatch_bytes = BATCH // micro * 16 * 32 * 4  # [rows, length, embed] f32, before the data split
  in_loop = [c for c in report.collectives(compiled.as_text()) if c.executions > 1]
  sends = collections.Counter()  # stage step (mod S) -> device-to-device sends per call
  for c in (c for c in in_loop if c.kind == "collective-permute"):
    assert c.bytes <= microbatch_bytes, (name, c)
    for src, dst in pairs(c, n):
      assert all(axis[src] == axis[dst] for axis in where.values()), (name, c)  # same data/model shard
      sends[(stage[dst] - stage[src]) % stages] += c.executions
  assert set(sends) == {1, stages - 1}, (name, sends)  # only to the next or the previous stage
  # Forward (s -> s+1) and backward (s+1 -> s): each device at least once per iteration.
  assert min(sends[1], sends[stages - 1]) >= iterations * n, (name, sends)
  assert sum(sends.values()) >= 2 * iterations * n, (name, sends)
  for c in (c for c in in_loop if c.kind != "collective-permute"):
    assert all(len({stage[d] for d in g}) == 1 for g in replica_groups.groups(c.replica_groups, n)), (name, c)
  if CASES[name][5] == "pp_dp":  # microbatching keeps rows on their devices: no resharding...
    assert set(report.collective_summary(compiled.as_text())) <= {"all-reduce", "collective-permute", "all-gather"}
    # ... but the one gather, before the loop, of the rows that the embedding (and the head)
    # split over the stage groups too (rules.split_over_stages): along `stage` alone
    for c in (c for c in report.collectives(compiled.as_text()) if c.kind == "all-gather"):
      assert c.executions == 1, (name, c)
      for g in replica_groups.groups(c.replica_groups, n):
        assert all(len({axis[d] for d in g}) == 1 for axis in where.values()), (name, c)


def test_each_device_holds_one_stage_of_the_layer_weights(pipelined):
  name, setup, params, _, _, _ = pipelined
  stages, preset = CASES[name][0], CASES[name][5]
  total = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
  local = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params["layers"]))
  rows = report.param_table(setup.abstract["params"]["layers"], setup.shardings["params"]["layers"],
                            setup.param_axes["layers"])
  assert all(sh.spec[0] == "stage" for sh in jax.tree.leaves(setup.shardings["params"]["layers"]))
  assert sum(r.bytes_per_device for r in rows) == local
  if preset == "pp_dp":
    assert local == total // stages
  else:  # tensor / 2D rules split a stage's weights further
    assert local < total // stages


def compiled_step(stages, micro, layers, batch=128, remat=None):
  """AOT-compiled loss+grads of an (L layers, S=stages, M=micro, R=1) pp_dp model on (stage=4, data=2)."""
  setup = setup_for(tiny_lm(layers, batch, stages, micro, ici=(4, 2), axes=("stage", "data"), preset="pp_dp",
                            extra=[f"model.remat={remat!r}"] if remat else []))
  fn = jax.jit(lambda p, b: step_lib.grads_and_loss(setup, p, b)[:2],
               in_shardings=(setup.shardings["params"], setup.batch_sharding),
               out_shardings=(setup.replicated, setup.shardings["params"]))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    return fn.lower(setup.abstract["params"], step_lib.abstract_batch(setup)).compile()


def test_activation_memory_is_one_microbatch_per_stage_per_iteration():
  """Backward saves only each iteration's stage input, not every layer's (nor all M outputs).

  Measured on this CPU (128 x 16 tokens, d_model 32, 4 stages): temp bytes per device
  (L=8, M=4) 3.72 MB, (L=8, M=8) 2.29 MB, (L=16, M=8) 3.37 MB (2026-11-26, the last M
  outputs in the carry; 3.82, 2.33 and 3.42 MB as T scan outputs; with the head on all rows
  of every stage group, before rules.split_over_stages, 3.59, 3.14 and 3.20 MB, when the
  head's full-batch buffers set the peak). What 2 more layers per stage add now
  (1.1 MB) is the recomputed iteration's per-layer residuals of one microbatch. Before
  (per-block saves in every iteration, `held` carried): 16.4, 13.4 and 23.7 MB, i.e. the
  same 2 layers added 10.3 MB.
  """
  temp = {(L, M): report.memory(compiled_step(4, M, L))["temp_bytes"] for L, M in [(8, 4), (8, 8), (16, 8)]}
  assert temp[8, 8] < 1.25 * temp[8, 4], temp     # 2x microbatches (same batch): not 2x memory
  assert temp[16, 8] - temp[8, 8] < 3e6, temp     # 2x layers per stage: one iteration's more, not T's


def test_the_loop_keeps_the_last_m_outputs_not_one_per_iteration():
  """Only the last M iterations' outputs are results (microbatch m leaves the last stage at
  T - M + m): the loop writes them into M slots of its carry. As scan outputs all T = M*R + S - 1
  of them stayed alive until after the loop (moe.maverick_4slices: 4.07 GiB per chip).
  Here S=4, M=4, R=4: T = 19; fails with the outputs stacked per iteration."""
  setup = setup_for(tiny_lm(16, 128, 4, 4, 4, ici=(4, 2), axes=("stage", "data"), preset="pp_dp"))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    jaxpr = jax.make_jaxpr(step_lib.loss_fn(setup))(setup.abstract["params"], step_lib.abstract_batch(setup))
  loops = [e for e in equations(jaxpr.jaxpr) if e.primitive.name == "scan" and e.params["length"] == 19]
  assert loops
  for e in loops:
    stacked = e.outvars[e.params["num_carry"]:]
    assert not [v for v in stacked if v.aval.ndim >= 4 and v.aval.shape[-1] == 32], stacked


def test_the_head_runs_on_one_stage_groups_share_of_the_rows():
  """pp_ presets split the batch over the stages outside the loop (rules.split_over_stages):
  each of the 4 stage groups computes the logits of 1/4 of its data shard's rows
  (128 rows / (4 stages x 2 data) = 16), not all 64 of them in every group."""
  text = compiled_step(4, 8, 8).as_text()
  assert {int(r) for r in re.findall(r"f32\[(\d+),16,256\]", text)} == {128 // 8}


def test_full_remat_recomputes_each_layer_once_inside_the_pipeline():
  """The pipeline's per-iteration checkpoint is the one recompute: with model.remat='full'
  the compiled step has the FLOPs of remat='none' (4 forward-equivalents), not one more
  forward of every layer on top (5: the block's own full remat inside the recomputed stage).
  Measured (8 layers, 4 stages, M=4, d_model 32): full / none = 1.00 (before: 1.21)."""
  flops = {r: costs_lib.of_compiled(compiled_step(4, 4, 8, batch=32, remat=r)).flops for r in ("none", "full")}
  assert flops["full"] < 1.05 * flops["none"], flops


def test_one_unit_visits_keep_the_recomputed_layer_whole():
  """A visit of one unit (4 layers, 4 stages) has no layer loop to recompute twice: remat='full'
  runs there as 'none' (pipeline.stage_remat), the same program, not 'dots', whose backward
  redoes the elementwise work (measured: 2.90e7 against 2.81e7 bytes accessed; on 8 CPU
  devices at R=2, 4-6% slower). Fails with 'full' mapped to 'dots' for every visit."""
  cost = {r: costs_lib.of_compiled(compiled_step(4, 4, 4, batch=32, remat=r)) for r in ("none", "full", "dots")}
  assert (cost["full"].flops, cost["full"].bytes_accessed) == (cost["none"].flops, cost["none"].bytes_accessed)
  assert cost["dots"].bytes_accessed > 1.02 * cost["full"].bytes_accessed, cost


def test_plain_schedule_has_no_all_reduce_of_activations_in_its_loop():
  """R = 1: the last stage's outputs leave as scan outputs, taken once after the loop.

  Inside the loop only the buffer's collective-permutes and the data-parallel gradient
  all-reduces (layers/) run; the pipeline's own all-reduces (its outputs to every stage
  group, the inputs' cotangent summed over stages) run once. Measured (L=8, M=8):
  before, 22 all-reduce executions from pipeline/loop.py (each iteration's broadcast
  into `held`, forward and backward); now 2, both outside the loop.
  """
  cols = report.collectives(compiled_step(4, 8, 8).as_text())
  in_loop = [c for c in cols if c.executions > 1]
  assert {c.kind for c in in_loop} == {"all-reduce", "collective-permute"}
  assert not [c for c in in_loop if c.kind == "all-reduce" and "pipeline/" in c.source], in_loop
  ours = [c for c in cols if c.kind == "all-reduce" and "pipeline/" in c.source]
  assert 0 < sum(c.executions for c in ours) <= 2, ours


def test_pipelined_init_is_the_unpipelined_init_restacked():
  """Same seed, same weights: the L layers are created as usual, then restacked (eagerly, tiny)."""
  params = {}
  for stages in (1, 4):
    cfg = experiment(*CASES["S4_M4_R2_stage4xdata2_2d"][:3]) if stages > 1 else experiment()
    model = models.build(cfg.model, nnx.Rngs(params=0))
    params[stages] = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  np.testing.assert_array_equal(params[4]["embed"]["embedding"], params[1]["embed"]["embedding"])
  for a, b in zip(jax.tree.leaves(pipeline.unstage_params(params[4]["layers"], 2)),
                  jax.tree.leaves(params[1]["layers"]), strict=True):
    np.testing.assert_array_equal(a, b)


def test_schedule_runs_every_microbatch_and_repeat_once_per_stage():
  for s, m, r, delay in [(2, 2, 1, 0), (4, 8, 1, 0), (4, 4, 2, 0), (3, 5, 3, 0), (3, 6, 2, 1), (2, 5, 2, 1)]:
    sched = pipeline.Schedule(s, m, r, delay_shift=bool(delay))
    h = 1 + delay
    assert sched.iterations == m * r + h * (s - 1)
    assert sched.bubble_fraction == pytest.approx(h * (s - 1) / (m * r + h * (s - 1)))
    for stage in range(s):
      work = [sched.work(t, stage) for t in range(sched.iterations)]
      assert sorted(w for w in work if w) == [(i, j) for i in range(m) for j in range(r)]
      assert sum(w is None for w in work) == h * (s - 1)
  # A microbatch re-enters stage 0 for repeat r+1 only after leaving stage S-1 in repeat r.
  sched = pipeline.Schedule(4, 4, 2)
  for mb in range(4):
    leave = next(t for t in range(sched.iterations) if sched.work(t, 3) == (mb, 0))
    enter = next(t for t in range(sched.iterations) if sched.work(t, 0) == (mb, 1))
    assert enter > leave


def toy_layers(w, x, positions):
  """A stack of layers x -> tanh(x @ w[i] + positions), in order (a stand-in stage body)."""
  def layer(h, wi):
    return jnp.tanh(h @ wi + positions[..., None] * 0.01), None
  return jax.lax.scan(layer, x, w)[0]


@pytest.mark.parametrize("stages,micro,repeats,batch,delay", [
    (3, 5, 2, 10, False), (4, 4, 1, 2, False), (3, 6, 2, 12, True), (3, 7, 2, 14, True),
    (2, 6, 2, 12, True), (3, 4, 1, 8, True)])
def test_run_equals_the_layers_in_order_with_its_gradients(stages, micro, repeats, batch, delay):
  """No mesh, toy layers: the schedule alone (delay: the delayed shift, its circular queue
  entering at the last group (M=7: wait 2 < S), at group 0 for a lap (S=2, M=6) or not
  waiting (M = 2S)); R=1 delayed too;
  a batch < M (decoding) runs the layers in order."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.normal(size=(stages * repeats * 2, 8, 8)) / 3, jnp.float32)
  x = jnp.asarray(rng.normal(size=(batch, 3, 8)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(3), (batch, 3))
  sched = pipeline.Schedule(stages, micro, repeats, delay_shift=delay)
  piped = lambda w, x: jnp.sum(pipeline.run(toy_layers, pipeline.to_stages(w, stages, repeats), x, pos,
                                            sched, ("batch", "length", "embed")) ** 2)
  plain = lambda w, x: jnp.sum(toy_layers(w, x, pos) ** 2)
  got = jax.jit(jax.value_and_grad(piped, argnums=(0, 1)))(w, x)
  want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(w, x)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stages,repeats", [(4, 1), (2, 2)])
def test_each_stage_holds_and_runs_its_layers_in_order(stages, repeats):
  """8 layers, each layer's weight its own index l; a layer maps h -> h * 8 + l, so the
  output's base-8 digits spell the layers in the order the pipeline ran them."""
  n, micro = 8, 4
  ids = jnp.arange(n, dtype=jnp.float32)
  staged = pipeline.to_stages(ids, stages, repeats).reshape(stages, repeats, -1)
  per = n // (stages * repeats)
  for s in range(stages):       # the layout the docs give: stage s, repeat r, layer j
    for r in range(repeats):
      assert list(staged[s, r]) == [r * n // repeats + s * per + j for j in range(per)]

  def digits(w, x, positions):  # a stage body: its layers in their stacked order
    return jax.lax.scan(lambda h, l: (h * n + l, None), x, w)[0]

  x = jnp.zeros((8, 3, 2), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(3), (8, 3))
  out = pipeline.run(digits, pipeline.to_stages(ids, stages, repeats), x, pos,
                     pipeline.Schedule(stages, micro, repeats), ("batch", "length", "embed"))
  value = np.asarray(out, np.int64)
  assert (value == value.flat[0]).all()
  ran = [int(value.flat[0]) // n ** k % n for k in reversed(range(n))]
  assert ran == list(range(n)), ran


def test_bad_pipeline_shapes_fail_with_clear_errors():
  with pytest.raises(ConfigError, match="not divisible by pipeline stages"):
    experiment(stages=3, micro=3)
  with pytest.raises(ConfigError, match="needs microbatches >= stages"):
    experiment(stages=4, micro=2, repeats=2)
  with pytest.raises(ConfigError, match="do nothing without a pipeline"):
    experiment(micro=4)
  with pytest.raises(ConfigError, match="grads_in_layout=False do nothing without a pipeline"):
    experiment(1, 1, 1, (1, 1), ("data", "model"), "dp", "model.pipeline.grads_in_layout=False")
  setup = setup_for(experiment(2, 3, 1, (2, 4), ("stage", "data"), "pp_dp"))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules), \
      pytest.raises(ValueError, match="not divisible by model.pipeline.microbatches=3"):
    jax.eval_shape(step_lib.loss_fn(setup), setup.abstract["params"], step_lib.abstract_batch(setup))
  setup = setup_for(experiment(2, 8, 1, (2, 4), ("stage", "data"), "pp_dp"))  # 2 rows, data=4
  with jax.set_mesh(setup.mesh), use_rules(setup.rules), \
      pytest.raises(ValueError, match="data-parallel degree 4"):
    jax.eval_shape(step_lib.loss_fn(setup), setup.abstract["params"], step_lib.abstract_batch(setup))


def test_gpt3_175b_pipelined_builds_abstractly_and_lowers():
  cfg = configs.get("lm.gpt3_175b_pipelined")
  # 8 CPU devices; the splash kernel compiles for TPUs only
  configs.apply_overrides(cfg, ["mesh.ici=(4, 2, 1)", "mesh.topology=None", "model.attention='xla'"])
  setup = setup_for(configs.build(cfg))
  assert 174e9 < state_lib.count_params(setup) < 175e9
  kernel = setup.abstract["params"]["layers"]["blocks"]["mlp"]["up"]["kernel"]
  assert kernel.shape == (4, 4, 6, 12288, 32768) and kernel.sharding.spec[0] == "stage"
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    lowered = step_lib.train_step_fn(setup).lower(setup.abstract, step_lib.abstract_batch(setup))
  assert "stage" in lowered.as_text()


def tiny_pipelined(job_overrides=()):
  cfg = configs.get("lm.tiny_pipelined")
  configs.apply_overrides(cfg, [
      "model.d_model=32", "model.num_heads=4", "model.d_ff=64", "model.max_len=16",
      "data.seq_len=16", "data.source='synthetic'", "train.global_batch=16", "train.steps=6",
      "train.eval_every=3", "train.eval_batches=1", "train.log_every=3", "checkpoint.every=3",
      "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=1", *job_overrides])
  return configs.build(cfg)


def test_tiny_pipelined_trains_and_resumes(tmp_path):
  exp = tiny_pipelined()
  assert (exp.model.pipeline.stages, dict(zip(exp.mesh.axes, exp.mesh.ici))["stage"]) == (2, 2)
  job = str(tmp_path / "job")
  summary = loop.train(exp, job)
  evals = summary["eval_losses"]
  assert summary["final_step"] == 6 and evals[6] < evals[0] - 0.05, evals
  # A run stopped after step 3 resumes from its checkpoint and repeats the same losses.
  resumed_job = str(tmp_path / "resumed")
  shutil.copytree(os.path.join(job, "checkpoints", "3"), os.path.join(resumed_job, "checkpoints", "3"))
  resumed = loop.train(exp, resumed_job)
  assert resumed["start_step"] == 3
  for step in (6,):
    np.testing.assert_allclose(resumed["losses"][step], summary["losses"][step], rtol=1e-5)


@pytest.mark.slow  # a TPU compile: ~15 s on a quiet 2-core host, 47 s under load
def test_delayed_shift_runs_beside_the_stage_body_in_the_tpu_program():
  """TPU program (libtpu, v4:2x2x2): with delay_shift the forward stage shift's
  collective-permute-start and -done bracket the stage body's layer loop, and the step
  model hides it behind that loop; the same permute with nothing between start and done
  (the evidence removed) is priced as exposed. (At d_model 64 x 32 tokens the scheduler
  saw too little compute to move the done past the loop: the size matters.)"""
  pytest.importorskip("libtpu")
  import dataclasses
  from shardax.perf import hardware, dry_run, stepmodel
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "data.source='synthetic'", "model.num_layers=4", "model.d_model=256", "model.num_heads=4",
      "model.d_ff=1024", "data.seq_len=128", "model.max_len=128", "train.global_batch=32",
      "model.pipeline.stages=2", "model.pipeline.microbatches=4", "model.pipeline.delay_shift=True",
      "mesh.axes=('stage','data','model')", "mesh.ici=(2,4,1)", "mesh.topology='v4:2x2x2'",
      "mesh.num_cpu_devices=None", "sharding.preset='pp_dp'"])
  exp = configs.build(cfg)
  mesh, setup = dry_run.prepare(exp)
  costs = costs_lib.of_compiled(dry_run.compile_step(setup))
  where = coordinates(mesh.shape)
  shifts = [c for c in costs.collectives if c.kind == "collective-permute" and c.executions > 1
            and all(where["stage"][a] != where["stage"][b] for a, b in pairs(c, mesh.size))]
  spanning = [c for c in shifts if c.loops_between]
  assert spanning, [(c.computation, c.compute_between, c.loops_between) for c in shifts]
  assert all(c.is_async and c.compute_between > 0 for c in spanning)
  chip = hardware.lookup(mesh.devices.flat[0].device_kind)
  exposed = lambda cs: stepmodel.from_costs(cs, mesh, exp, chip).breakdown["collectives"]["exposed_seconds"]
  bare = tuple(dataclasses.replace(c, loops_between=(), compute_between=0) if c in spanning else c
               for c in costs.collectives)
  assert exposed(dataclasses.replace(costs, collectives=bare)) > exposed(costs)


@pytest.mark.slow  # a 512-chip TPU compile of a 16-layer GPT-3: ~30 s on a quiet 2-core host
def test_stage_weight_gradients_are_not_all_reduced_in_full_on_tpu():
  """lm.gpt3_175b_pipelined cut to 16 layers (4 stages x 4 repeats, one layer a visit) on
  v4:8x8x8: each visit's weight gradients leave the stage body in the weights' stored layout
  (`pipeline.run(weight_axes=...)`), reduce-scattered over `data`. Without the constraint
  the TPU partitioner all-reduced four of them in full per visit (75 MB bf16 pieces: 204
  synchronous all-reduces over the 32 data chips for 51 visits) and kept a slice; with it
  one remains per visit, and the full-depth step needs 4.75 GiB less temp (docs/pipeline.md)."""
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  cfg = configs.get("lm.gpt3_175b_pipelined")
  configs.apply_overrides(cfg, ["model.num_layers=16"])
  exp = configs.build(cfg)
  mesh, setup = dry_run.prepare(exp)
  cols = report.collectives(dry_run.compile_step(setup).as_text())
  visits = exp.train.microbatches * pipeline.Schedule(4, 12, 4).iterations
  data = mesh.shape["data"]
  full = [c for c in cols if c.kind == "all-reduce" and not c.is_async and c.group_size == data
          and "quantization.py" in c.source and c.executions > 1]
  assert sum(c.executions for c in full) <= visits, [(c.bytes, c.executions) for c in full]
