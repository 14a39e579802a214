"""What MoE routing drops is seen: summed over every step of a logging window, on the
progress line, in one warning naming the layer, in eval, and as a stated bet in explain and
the dry run (trainer/moe_drops.py)."""

import json
import os
import re

import numpy as np
import pytest

from shardax import configs
from shardax.sharding import rules as rules_lib
from shardax.trainer import moe_drops

from clitools import command, run

# moe.tiny (capacity dispatch, 'random' second expert: the copies routed vary by step) at 4
# layers (MoE layers 1 and 3), with too few slots per expert for its tokens: copies drop.
DROPPING = ["model.num_layers=4", "model.d_model=32", "model.moe.d_ff=32", "data.source='synthetic'",
            "model.moe.capacity_factor=0.5", "model.moe.min_capacity=1", "train.steps=6",
            "checkpoint.enabled=False"]


def rows(job_dir) -> dict[int, dict]:
  """metrics.jsonl's rows by step (a step's training and eval rows merged)."""
  out: dict[int, dict] = {}
  for line in open(os.path.join(job_dir, "metrics.jsonl")):
    row = json.loads(line)
    out.setdefault(row["step"], {}).update(row)
  return out


def test_a_window_sums_every_step_and_the_run_says_what_it_drops(tmp_path):
  """The same 6 steps logged every step and every 3 steps (same seed, same data): each
  3-step window's dropped and routed copies are the sums of its steps' own, and its
  fraction is their ratio. The run with 3-step windows prints the fraction on its progress
  lines, warns once (both windows are above 1%) naming the layer that dropped the largest
  share and the field that changes it, and its evals report what they drop."""
  jobs = {every: tmp_path / f"every_{every}" for every in (1, 3)}
  out = {}
  for every, job in jobs.items():
    proc = run(command(job, tmp_path / "data", *DROPPING, f"train.log_every={every}", exp="moe.tiny"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out[every] = proc
  step, window = rows(jobs[1]), rows(jobs[3])
  assert [window[s]["loss"] for s in (3, 6)] == [step[s]["loss"] for s in (3, 6)]  # the same run
  for end in (3, 6):
    w = window[end]
    for key in ("moe/dropped_copies_count", "moe/routed_copies_count"):
      assert w[key] == sum(step[s][key] for s in range(end - 2, end + 1)), (end, key)
    assert w["moe/dropped_copies"] == w["moe/dropped_copies_count"] / w["moe/routed_copies_count"]
    assert w["moe/dropped_copies"] > 0.01
  # the steps differ, so a window that kept only its last step would not match
  assert len({step[s]["moe/dropped_copies_count"] for s in (1, 2, 3)}) > 1

  text = out[3].stdout + out[3].stderr
  for end in (3, 6):
    shown = moe_drops.percent(window[end]["moe/dropped_copies"])
    assert re.search(rf"step +{end}/6 \| loss \S+ \| MoE dropped {re.escape(shown)} of token copies", text), text
  warnings = re.findall(r"MoE routing dropped .*", text)
  assert len(warnings) == 1, warnings
  per_layer = {int(k.rsplit("_", 1)[1]): v for k, v in window[3].items()
               if k.startswith("moe/dropped_copies/layer_")}
  assert sorted(per_layer) == [1, 3]
  worst = max(per_layer, key=per_layer.get)
  assert "steps 1-3" in warnings[0] and f"most in layer {worst} (" in warnings[0], warnings
  assert "model.moe.capacity_factor (now 0.5" in warnings[0] and "warn_dropped_fraction" in warnings[0]
  for at in (0, 6):   # eval routes deterministically (both experts of each token) and drops too
    assert window[at]["eval_moe/dropped_copies"] > 0
    shown = moe_drops.percent(window[at]["eval_moe/dropped_copies"])
    assert re.search(rf"step +{at}/6 \| eval_loss \S+ \| MoE dropped {re.escape(shown)} of token copies",
                     text), text


def test_the_threshold_field_silences_the_warning_and_is_checked():
  """A threshold above what the run drops warns of nothing; a threshold outside [0, 1] is
  refused naming the field."""
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, ["model.moe.warn_dropped_fraction=1.5"])
  with pytest.raises(Exception, match=r"model\.moe\.warn_dropped_fraction=1\.5 must be in \[0, 1\]"):
    configs.build(cfg)
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, ["model.moe.warn_dropped_fraction=0.5"])
  warn = moe_drops.OnceWarning(configs.build(cfg).model)
  assert warn.check(1, 3, moe_drops.Drops(np.array([100.0, 100.0]), np.array([40.0, 50.0]))) is None
  assert warn.check(4, 6, moe_drops.Drops(np.array([100.0, 100.0]), np.array([40.0, 70.0])))


def registered(name: str, *sets: str):
  cfg = configs.get(name)
  configs.apply_overrides(cfg, list(sets))
  exp = configs.build(cfg)
  return exp, dict(zip(exp.mesh.axes, exp.mesh.ici)), rules_lib.resolve(exp.sharding.preset, exp.sharding.rules)


def test_deepseek_v3_states_its_bet_on_balance():
  """moe.deepseek_v3 (the ragged exchange at 1.25 fair shares, overflow dropped, 64 expert
  shards of 256 top-8 experts: the bound is 64 x 4 / 8 = 32) says so, with the field that
  changes it; at the bound, or without expert parallelism, there is no bet."""
  line = moe_drops.bet(*registered("moe.deepseek_v3"))
  assert line is not None
  for words in ("expert_buffer=1.25 fair shares", "64 expert shards", "the no-overflow bound is 32",
                "are dropped", "Change it: model.moe.expert_buffer", "expert_overflow='error'"):
    assert words in line, (words, line)
  assert moe_drops.bet(*registered("moe.deepseek_v3", "model.moe.expert_buffer=None")) is None
  assert "stops the run" in moe_drops.bet(*registered("moe.deepseek_v3", "model.moe.expert_overflow='error'"))
  assert "C=4 token copies per group of 2048" in moe_drops.bet(*registered("moe.gshard_1t"))
  assert moe_drops.bet(*registered("moe.mixtral_8x7b")) is None   # no expert axis: nothing to overflow


def test_explain_and_the_dry_run_print_the_bet(tmp_path):
  """--mode=explain and --mode=dry_run of a dropless expert-parallel MoE at a buffer below
  the bound (2 shards, top-2 of 8: bound 2) print the line, in their reports too."""
  sets = ["model.moe.dispatch='dropless'", "model.moe.top_k=2", "model.num_layers=2",
          "model.d_model=32", "model.moe.d_ff=32", "data.source='synthetic'", "mesh.ici=(2, 1)",
          "model.moe.expert_buffer=1.0", "model.moe.expert_overflow='drop'"]
  for mode, report in (("explain", "explain.json"), ("dry_run", "dry_run.json")):
    proc = run(command(tmp_path / mode, tmp_path / "data", *sets, exp="moe.tiny", mode=mode), devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MoE routing bets on balance: each device's expert-parallel buffer holds expert_buffer=1 " \
           "fair shares" in proc.stdout, proc.stdout[-3000:]
    saved = json.loads((tmp_path / mode / report).read_text())["balance_bet"]
    assert saved and "the no-overflow bound is 2" in saved


# moe.deepseek_tiny (dropless, sigmoid top-k, a first dense layer) at 3 layers (MoE layers 1 and
# 2) with one MTP depth, its experts split over 2 devices whose buffers hold half a fair share:
# the stack's MoE layers and the MTP module's MoE block both drop copies past it.
MTP_DROPPING = ["model.num_layers=3", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
                "model.max_len=16", "data.seq_len=16", "train.global_batch=4", "data.source='synthetic'",
                "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.d_ff=16",
                "model.moe.expert_buffer=0.5", "model.moe.expert_overflow='drop'",
                "model.mtp.depth=1", "model.mtp.loss_weight=0.3", "mesh.ici=(2, 1)"]


def test_the_mtp_blocks_drops_are_reported_beside_the_layers():
  """A DeepSeek-V3-like model whose MTP block routes through a too-small expert buffer: the
  train step's counts list the stack's MoE layers, then the MTP block; the report names it
  'mtp_1' beside 'layer_1' and 'layer_2', with the drops that the model without MTP (the same
  main params: the MTP module is built last) does not have, out of every token's top-k
  copies; the totals count them; the warning names the MTP block when it drops the most."""
  import jax
  from meshtools import loss_and_grads, setup_for
  from shardax.trainer import state as state_lib

  b, l, k = 4, 16, 2
  counts = {}
  for name, extra in (("on", []), ("off", ["model.mtp=None"])):
    cfg = configs.get("moe.deepseek_tiny")
    configs.apply_overrides(cfg, MTP_DROPPING + extra)
    exp = configs.build(cfg)
    setup = setup_for(exp, jax.devices()[:2])
    params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
    batch = {"inputs": np.random.default_rng(0).integers(1, 256, (b, l)).astype(np.int32)}
    batch["targets"] = np.roll(batch["inputs"], -1, axis=1)
    (_, _, metrics), _ = loss_and_grads(setup, params, batch)
    counts[name] = (exp.model, moe_drops.of_metrics([metrics]))
  model, on = counts["on"]
  off = counts["off"][1]
  assert on.routed.shape == (3,) and off.routed.shape == (2,)
  np.testing.assert_array_equal(on.routed[:2], off.routed)      # the stack routes what it did
  np.testing.assert_array_equal(on.dropped[:2], off.dropped)
  assert on.routed[2] == b * l * k                               # every position's top-k copies
  mtp_dropped = on.dropped.sum() - off.dropped.sum()
  assert mtp_dropped > 0
  report = moe_drops.scalars(on, model)
  per_layer = {key.split("/")[-1]: v for key, v in report.items() if key.startswith("moe/dropped_copies/")}
  assert sorted(per_layer) == ["layer_1", "layer_2", "mtp_1"]
  assert per_layer["mtp_1"] == mtp_dropped / (b * l * k)
  assert report["moe/dropped_copies_count"] == on.dropped.sum()
  assert report["moe/dropped_copies"] == on.dropped.sum() / on.routed.sum()
  # evaluation runs no MTP: its counts name the stack's layers alone
  assert sorted(moe_drops.names(model, 2)) == ["layer_1", "layer_2"]
  with pytest.raises(ValueError, match=r"4 MoE drop counts .* expected 2 \(evaluation\) or 3 \(training\)"):
    moe_drops.names(model, 4)
  worst = moe_drops.Drops(on.routed, np.array([0.0, 1.0, on.routed[2] / 2]))
  assert moe_drops.worst_layers(worst, model).startswith("MTP depth 1 (50.00% of its copies), layer 2 (")


# Which layer a count is labelled with: moe.tiny shrunk (8 experts, top-2 'all', groups of one
# 16-token sequence, C = ceil(3.75 x 2 x 16 / 8) = 15 slots): an expert overflows only when all 16
# tokens of a sequence pick it, which none of these randomly initialized routers does (the test
# checks that every other count is 0), but a layer whose router kernel is zero sends every token
# to experts 0 and 1 (a tie: top-k takes the lowest index) and drops 16 - 15 copies at each, per
# sequence. So exactly one count is non-zero: the zeroed layer's.
LABELLED = ["model.d_model=32", "model.num_heads=4", "model.d_ff=64", "model.max_len=16", "data.seq_len=16",
            "train.global_batch=4", "data.source='synthetic'", "model.moe.num_experts=8", "model.moe.d_ff=16",
            "model.moe.capacity_factor=3.75", "model.moe.min_capacity=1", "model.moe.second_expert='all'"]
LLAMA4_LIKE = "model.layer_pattern=({'chunk': 4}, {'chunk': 4}, {'chunk': 4}, {'rope': False})"
TWO_KINDS = "model.layer_pattern=({'chunk': 4}, {'rope': False})"
PIPELINED = ["model.pipeline.stages=2", "model.pipeline.microbatches=2", "sharding.preset='pp_dp'",
             "mesh.ici=(2, 1)", "mesh.axes=('stage', 'data')"]


def moe_routers(layers: dict, cfg) -> dict[int, tuple]:
  """{0-based model layer: (its MoE block's router-kernel dict, the index into that kernel)} of a
  model's `layers` params, found from the stack's structure (layers/transformer.py LayerStack):
  a scanned unit's blocks are stacked on a leading units dim (a pipelined one's in the stage
  layout, indexed here through `pipeline.to_stages` of the unit numbers)."""
  from shardax import pipeline
  first, per = cfg.num_first_dense, cfg.layers_per_unit
  p = cfg.pipeline
  unit_at = ((lambda u: tuple(int(i) for i in np.argwhere(np.asarray(pipeline.to_stages(
      np.arange(cfg.num_stack_units), p.stages, p.circular_repeats)) == u)[0]))
             if p.stages > 1 else (lambda u: (u,)))
  out = {}
  for u in range(cfg.num_stack_units):
    blocks = (layers["blocks"]["blocks"] if cfg.layer_pattern
              else {per - 1: layers["blocks"]["moe_block"]})      # a Unit: its dense blocks, then MoE
    for i, block in blocks.items():
      if "moe" in block:
        out[first + u * per + i] = (block["moe"]["router"], unit_at(u))
  tail = layers.get("tail") or {"blocks": {}}
  for i, block in tail["blocks"].items():
    if "moe" in block:
      out[first + cfg.num_stack_units * per + i] = (block["moe"]["router"], ())
  return out


@pytest.mark.parametrize("sets,zeroed", [
    # a Llama-4-like pattern (3 chunked layers, 1 NoPE), MoE every 2nd layer: 2 scanned units of 4 layers (2 MoE
    # blocks each) and a tail of 2 (1 MoE block); MoE layers 1, 3, 5, 7, 9
    ([LLAMA4_LIKE, "model.num_layers=10", "model.moe.every=2"], 5),
    ([LLAMA4_LIKE, "model.num_layers=10", "model.moe.every=2"], 9),
    # no pattern, a first dense layer, then units of (dense, MoE): MoE layers 2 and 4
    (["model.num_layers=5", "model.moe.every=2", "model.moe.first_dense_layers=1"], 4),
    # the pattern pipelined: 2 stages of one 4-layer unit (2 MoE blocks); MoE layers 1, 3, 5, 7
    ([LLAMA4_LIKE, "model.num_layers=8", "model.moe.every=2", *PIPELINED], 5),
    # a 2-kind pattern pipelined, 2 stages x 2 circular repeats of one 2-layer unit: layer 5 is
    # unit 2, on stage 0 in its second repeat
    ([TWO_KINDS, "model.num_layers=8", "model.moe.every=2", *PIPELINED, "model.pipeline.circular_repeats=2"], 5),
])
def test_each_count_is_labelled_with_the_layer_that_dropped(sets, zeroed):
  """One MoE layer's router made to overflow (the rest drop nothing): in the train step's
  per-layer counts, the one count that is not 0 is labelled with that layer, and the other
  labels are the model's other MoE layers; decoding through the same weights names it too."""
  import jax
  from flax import nnx
  from meshtools import loss_and_grads, setup_for
  from shardax.layers.attention import CacheSpec, default_positions
  from shardax.layers.transformer import TransformerLM
  from shardax.trainer import decode, state as state_lib

  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, LABELLED + sets)
  exp = configs.build(cfg)
  model = exp.model
  setup = setup_for(exp, jax.devices()[:2] if model.pipeline.stages > 1 else jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  routers = moe_routers(params["layers"], model)
  blocks = list(range(model.num_first_dense, model.num_layers))
  assert sorted(routers) == [i for i in blocks if (i - model.num_first_dense) % model.moe.every == model.moe.every - 1]
  router, at = routers[zeroed]
  router["kernel"] = np.asarray(router["kernel"]).copy()
  router["kernel"][at] = 0.0
  b, l = 4, 16
  batch = {"inputs": np.random.default_rng(0).integers(1, 256, (b, l)).astype(np.int32)}
  batch["targets"] = np.roll(batch["inputs"], -1, axis=1)
  (_, _, metrics), _ = loss_and_grads(setup, params, batch)
  drops = moe_drops.of_metrics([metrics])
  labels = moe_drops.names(model, len(drops.dropped))
  assert labels == [f"layer_{i}" for i in sorted(routers)]
  assert {name: d for name, d in zip(labels, drops.dropped) if d} == {f"layer_{zeroed}": 2 * b * (16 - 15)}
  assert f"most in layer {zeroed} (" in moe_drops.OnceWarning(model).check(1, 1, drops)

  # decode: a prefill of the batch through the same weights, with the training
  # config's capacity (not `for_decode`'s), is refused naming that layer alone
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(model, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, params)
  lm = nnx.merge(graphdef, state)
  cache = jax.tree.map(lambda c: np.zeros(c.shape, c.dtype), lm.cache_spec(b, l),
                       is_leaf=lambda c: isinstance(c, CacheSpec))
  _, _, dropped = jax.jit(lambda t, p, c: lm.cached(t, p, c))(batch["inputs"], default_positions(b, l), cache)
  named = rf"decode \(prefill\): MoE layer {zeroed} \({2 * b} copies\) routed"
  with pytest.raises(decode.DroppedCopiesError, match=named):
    decode.check_dropped(model, dropped, "prefill")
