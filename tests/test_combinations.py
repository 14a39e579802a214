"""The combination matrix: model x layout x 8-bit mode, on packed documents.

Each cell either computes what one device computes (loss and every gradient, amax histories'
next values included) or is refused at config time with an error naming the combination.
Models: the dense LM and the same LM with MoE layers (dropless top-2 of 4 experts every 2nd
layer). Layouts on 8 simulated devices: fsdp (8,), 2d (2 data x 4 model), dp_cp with
all-gather and with ring attention (2 data x 4 context), 2 pipeline stages (2 stage x 4
data, 2 microbatches), expert parallelism (2 data x 4 expert; MoE only). Modes: no
quantization, int8, fp8 with delayed scaling. Compute in float32, so the tolerances are those
of the existing equality tests: test_parallelism's for unquantized cells (loss rtol 1e-5,
gradients rtol 2e-4 / atol 2e-6), test_quantization's for 8-bit ones (loss rtol 5e-4,
gradients within 5% of their norm: a sharded program's other summation order moves values
across 8-bit rounding boundaries). MoE 8-bit cells allow 15%: such a flip can also move a
token whose top experts nearly tie to another expert (seen: int8 on (data 2, context 4) gives
a max expert load one token copy off the one-device run's, and every gradient upstream of
the MoE layer moves 4-8%; unquantized MoE cells are exact to the tight tolerances). fp8
histories start seen (`with_seen_histories`): the amax history's next values must then match.

The options the 2026 families brought (issue 49) are models of the matrix too, each a tiny
version of its family's attention or router on the same LM (`OPTION_MODELS`): attention sinks
beside a sliding window (gpt-oss), chunked-RoPE beside NoPE layers with temperature tuning
(Llama 4), Gemma's local/global kinds with post norms and soft-caps, multi-head latent attention
(DeepSeek-V3, alone and under its group-limited sigmoid router), gpt-oss's biased router with
biased, clamped experts and the balance loss pooled over layers, and group-limited routing under
GShard's capacity dispatch. Their sinks and biases start random (init puts them at 0, where a
path that dropped them would still agree). A cell that a path cannot run is refused by name
(`REFUSED`), at config time or when the step is traced. Greedy decode on a (2, 4) mesh is one
more cell per model (`DECODE_CELLS`).

The default suite runs a diagonal that reaches every model of the first three, every layout and
mode, and the cheaper option cells at least once (`DIAGONAL`); `-m slow` runs every cell, the
option models' heavier ones first (`OPTION_SLOW`). docs/combinations.md is the table of the full run
(before the option models).
"""

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from shardax import configs, pipeline
from shardax.configs.schema import ConfigError
from shardax.layers import quantization
from shardax.sharding import report, use_rules
from shardax.trainer import state as state_lib
import meshtools
from meshtools import loss_and_grads, setup_for

SEQ, BATCH = 32, 8
MODELS = {
    "dense": [],
    "moe": ["model.moe.num_experts=4", "model.moe.d_ff=32", "model.moe.every=2", "model.moe.top_k=2",
            "model.moe.dispatch='dropless'"],
    # GShard's capacity dispatch (random second expert, tokens past capacity dropped): under
    # context parallelism it keeps the natural token order (layers/transformer.py).
    "moe_capacity": ["model.moe.num_experts=4", "model.moe.d_ff=32", "model.moe.every=2",
                     "model.moe.capacity_factor=1.0", "model.moe.second_expert='random'"],
}
_MLA = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=16", "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6"]
_GPT_OSS_MOE = ["model.moe.router_bias=True", "model.moe.expert_bias=True", "model.moe.swiglu_limit=0.5"]
OPTION_MODELS = {
    "sinks_window": ["model.attention_sinks=True", "model.layer_pattern=({'window': 5}, {})",
                     "model.qkv_bias=True", "model.out_bias=True"],
    "chunk_nope": ["model.layer_pattern=({'chunk': 8}, {'rope': False, 'temperature_tuning': True})",
                   "model.temperature_floor_scale=4.0", "model.temperature_scale=0.5", "model.rope_interleave=True",
                   "model.qk_l2_norm=True"],
    "gemma": ["model.layer_pattern=({'window': 5, 'rope_theta': 100.0}, {})", "model.norm='rms_plus_one'",
              "model.post_norms=True", "model.qk_norm=True", "model.query_pre_attn_scalar=8.0",
              "model.attention_softcap=4.0", "model.final_logit_softcap=3.0", "model.activation='gelu'"],
    "mla": _MLA,
    "deepseek": [*_MLA, *MODELS["moe"], "model.moe.score='sigmoid'", "model.moe.n_group=2", "model.moe.topk_group=1",
                 "model.moe.renormalize=True", "model.moe.gate_scale=2.5", "model.moe.bias_update_rate=0.01",
                 "model.moe.num_shared_experts=1"],
    "moe_gpt_oss": [*MODELS["moe"], *_GPT_OSS_MOE, "model.moe.aux_loss_pooling='over_layers'"],
    "moe_group_capacity": ["model.moe.num_experts=4", "model.moe.d_ff=32", "model.moe.every=2",
                           "model.moe.capacity_factor=1.0", "model.moe.second_expert='all'", "model.moe.n_group=2",
                           "model.moe.topk_group=1", *_GPT_OSS_MOE],
}
MODELS.update(OPTION_MODELS)
# name -> (mesh.ici, mesh.axes, preset, extra overrides)
LAYOUTS = {
    "fsdp": ((8,), ("data",), "fsdp", []),
    "2d": ((2, 4), ("data", "model"), "2d", []),
    "dp_cp_allgather": ((2, 4), ("data", "context"), "dp_cp", ["model.context_parallel='allgather'"]),
    "dp_cp_ring": ((2, 4), ("data", "context"), "dp_cp", ["model.context_parallel='ring'"]),
    "pipeline_2": ((2, 4), ("stage", "data"), "pp_dp",
                   ["model.pipeline.stages=2", "model.pipeline.microbatches=2"]),
    "expert": ((2, 4), ("data", "expert"), "expert_axis", []),
}
QUANT = ("none", "int8", "fp8_delayed")
CAPACITY = ("moe_capacity", "moe_group_capacity")


def has_moe(model) -> bool:
  return any(o.startswith("model.moe.") for o in MODELS[model])


CELLS = [(m, lay, q) for m in MODELS for lay in LAYOUTS for q in QUANT
         if not (not has_moe(m) and lay == "expert") and not (m in CAPACITY and q != "none")]
DIAGONAL = [("dense", "fsdp", "int8"), ("moe", "2d", "none"), ("dense", "dp_cp_ring", "fp8_delayed"),
            ("moe", "dp_cp_allgather", "int8"), ("moe", "dp_cp_ring", "none"),
            ("dense", "pipeline_2", "fp8_delayed"), ("moe", "expert", "fp8_delayed"),
            ("moe", "pipeline_2", "none"), ("moe_capacity", "dp_cp_ring", "none"),
            ("sinks_window", "2d", "int8"), ("chunk_nope", "dp_cp_ring", "none"),
            ("moe_gpt_oss", "pipeline_2", "none"), ("moe_group_capacity", "expert", "none")]
# The option models' heavier cells (two to three times a cell above) run with `-m slow`, these first.
OPTION_SLOW = [("chunk_nope", "pipeline_2", "none"), ("gemma", "dp_cp_allgather", "fp8_delayed"),
               ("mla", "dp_cp_allgather", "int8"), ("deepseek", "expert", "none")]
# Refused cells: (exception, the words its error must hold).
# A pipeline stage draws no gating keys: GShard's random second expert is refused there (config).
# Chunked attention under context parallelism: refused when the attention is traced.
CHUNK_CP = (ValueError, "chunked attention .* with context parallelism")
REFUSED = {("moe_capacity", "pipeline_2"): (ConfigError, "second_expert='all' or dispatch='dropless'"),
           ("chunk_nope", "dp_cp_allgather"): CHUNK_CP, ("chunk_nope", "dp_cp_ring"): CHUNK_CP}


def experiment(model, quant, ici=(1,), axes=("data",), preset="dp", extra=()):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=4",
      "model.d_ff=128", f"model.max_len={SEQ}", f"data.seq_len={SEQ}", f"train.global_batch={BATCH}",
      "data.source='stdlib'", f"model.quantization={quant!r}", *MODELS[model],
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}", *extra])
  return configs.build(cfg)


def packed_batch(rng) -> dict:
  return meshtools.packed_batch(rng, BATCH, SEQ)


_REFERENCES = {}


def with_seen_histories(params: dict) -> dict:
  """fp8_delayed: every amax history as if steps had run (entries 4.0). An empty history
  scales each call by its own amax, and a pipeline or microbatch call sees part of the batch,
  so a first step legitimately differs from one device; from a seen history it must not."""
  return {k: with_seen_histories(v) if isinstance(v, dict) else
          (np.full_like(v, 4.0) if k == quantization.HISTORY else v) for k, v in params.items()}


def with_random_sinks_and_biases(params: dict, seed: int = 1) -> dict:
  """params with every sink logit and bias (attention, router, expert and balance biases) drawn
  from N(0, 0.5^2): at init they are 0, where a path that left one out would agree."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda p, a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype)
      if jax.tree_util.keystr(p).endswith(("['sinks']", "_bias']", "['bias']")) else a, params)


def reference(model, quant, extra=()):
  """(params, batch, loss, grads) of one device, cached per (model, quant, extra) across
  cells; extra: model overrides."""
  key = (model, quant, tuple(extra))
  if key not in _REFERENCES:
    setup = setup_for(experiment(model, quant, extra=extra), jax.devices()[:1])
    params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
    params = with_seen_histories(with_random_sinks_and_biases(params))
    batch = packed_batch(np.random.default_rng(0))
    (loss, grads, _), _ = loss_and_grads(setup, params, batch)
    _REFERENCES[key] = params, batch, float(loss), jax.device_get(grads)
  return _REFERENCES[key]


def pipeline_extra(model) -> list[str]:
  """The overrides a model takes in the 2-stage pipeline. An MoE model or a 2-kind layer
  pattern: 2 units (4 layers) for 2 stages. An MoE model's per-layer balance and router z
  losses are per microbatch (as with accumulation microbatches), its cross entropy over the
  whole packed batch (unlike them): with those losses' weights 0, one device's run is the
  reference; tests/test_pipeline_moe.py checks them against accumulation microbatches. A
  balance loss pooled over the layers ('over_layers') pools the expert shares, which are means
  over equal microbatches: it stays on, and must equal one device's."""
  if not has_moe(model):
    return ["model.num_layers=4"] if any(o.startswith("model.layer_pattern=") for o in MODELS[model]) else []
  zeroed = ["model.moe.z_loss_weight=0.0"]
  if "model.moe.aux_loss_pooling='over_layers'" not in MODELS[model]:
    zeroed.append("model.moe.aux_loss_weight=0.0")
  return ["model.num_layers=4", *zeroed]


def check_cell(model, layout, quant):
  ici, axes, preset, extra = LAYOUTS[layout]
  stages = 2 if layout == "pipeline_2" else 1
  model_extra = pipeline_extra(model) if stages > 1 else []
  refused = REFUSED.get((model, layout))
  if refused is not None:
    error, words = refused
    with pytest.raises(error, match=words):
      setup = setup_for(experiment(model, quant, ici, axes, preset, [*model_extra, *extra]))
      with jax.set_mesh(setup.mesh), use_rules(setup.rules):
        meshtools.grads_fn(setup).lower(setup.abstract_params, packed_batch(np.random.default_rng(0)))
    return
  params, batch, ref_loss, ref_grads = reference(model, quant, model_extra)
  if stages > 1:
    params = dict(params, layers=pipeline.stage_params(params["layers"], stages, 1))
  setup = setup_for(experiment(model, quant, ici, axes, preset, [*model_extra, *extra]))
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  grads = jax.device_get(grads)
  if layout.startswith("dp_cp"):   # the asked-for attention ran: ring permutes K/V, all-gather does not
    permutes = [o for o in report.collectives(compiled.as_text())
                if o.kind == "collective-permute" and "shard_map" in o.op_name]
    assert bool(permutes) == layout.endswith("ring"), (model, layout, len(permutes))
  if stages > 1:
    grads = dict(grads, layers=pipeline.unstage_params(grads["layers"], 1))
  name = f"{model} x {layout} x {quant}"
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads), name
  if quant == "none":
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, err_msg=name)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=name)
    return
  np.testing.assert_allclose(float(loss), ref_loss, rtol=5e-4, err_msg=name)
  bound = 0.15 if has_moe(model) else 0.05
  grads, histories = quantization.take_histories(grads)           # fp8_delayed: next amax histories
  ref_grads, ref_histories = quantization.take_histories(ref_grads)
  for h, r in zip(jax.tree.leaves(histories), jax.tree.leaves(ref_histories)):
    np.testing.assert_allclose(h, r, rtol=1e-3, err_msg=f"{name}: amax history")
  flat, ref_flat = ravel_pytree(grads)[0], ravel_pytree(ref_grads)[0]
  assert np.linalg.norm(flat - ref_flat) < bound * np.linalg.norm(ref_flat), name


@pytest.mark.parametrize("model,layout,quant", DIAGONAL)
def test_diagonal_cell_equals_one_device_or_is_refused(model, layout, quant):
  check_cell(model, layout, quant)


@pytest.mark.slow
@pytest.mark.parametrize("model,layout,quant", OPTION_SLOW + [c for c in CELLS if c not in DIAGONAL + OPTION_SLOW])
def test_every_cell_equals_one_device_or_is_refused(model, layout, quant):
  check_cell(model, layout, quant)


# model.remat='moe_matmuls' (layers/blocks.py) saves what it finds under the names
# 'expert_matmul' and the attention projections' names: in these cells those names sit on
# 8-bit matmul outputs, inside the expert-parallel and ring-attention shard_maps and inside a
# pipeline stage, also on MLA's projections beside a group-limited router and beside sinks. A
# policy changes what is recomputed, never a value: each cell must equal the one-device run
# without remat. The first runs by default, the others with `-m slow`.
REMAT_CELLS = [("moe", "expert", "int8"), ("moe", "dp_cp_ring", "fp8_delayed"), ("dense", "pipeline_2", "int8"),
               ("deepseek", "expert", "int8"), ("sinks_window", "dp_cp_ring", "int8")]


def with_remat(monkeypatch, layout: str, remat: str) -> None:
  """The layout's cells run with `model.remat=remat` (the one-device reference without it)."""
  ici, axes, preset, extra = LAYOUTS[layout]
  monkeypatch.setitem(LAYOUTS, layout, (ici, axes, preset, [*extra, f"model.remat={remat!r}"]))


@pytest.mark.parametrize("model,layout,quant", [
    c if i == 0 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(REMAT_CELLS)])
def test_moe_matmuls_remat_cell_equals_one_device(model, layout, quant, monkeypatch):
  with_remat(monkeypatch, layout, "moe_matmuls")
  check_cell(model, layout, quant)


@pytest.mark.slow
def test_moe_returned_remat_cell_equals_one_device(monkeypatch):
  """model.remat='moe_returned' saves the returned expert outputs inside the expert-parallel
  shard_map (one device has no exchange, so there it keeps the gate/up outputs only): equal."""
  with_remat(monkeypatch, "expert", "moe_returned")
  check_cell("moe", "expert", "int8")


# model.remat='offload_qkv' (layers/blocks.py OFFLOADED) parks the block input and q/k/v in host
# memory under their checkpoint names: on 8-bit projection outputs under ring attention beside
# MoE layers, inside the expert-parallel shard_map, and on MLA's compact projections (its
# query_proj and key_proj names). Each cell must equal the one-device run without remat; a
# pipeline refuses the policy when the config is built. The first runs by default.
OFFLOAD_CELLS = [("moe", "dp_cp_ring", "int8"), ("dense", "2d", "fp8_delayed"), ("moe", "expert", "none"),
                 ("mla", "dp_cp_allgather", "none")]


@pytest.mark.parametrize("model,layout,quant", [
    c if i == 0 else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(OFFLOAD_CELLS)])
def test_offload_qkv_remat_cell_equals_one_device(model, layout, quant, monkeypatch):
  with_remat(monkeypatch, layout, "offload_qkv")
  check_cell(model, layout, quant)


def test_offload_qkv_in_a_pipeline_cell_is_refused_by_name(monkeypatch):
  with_remat(monkeypatch, "pipeline_2", "offload_qkv")
  monkeypatch.setitem(REFUSED, ("dense", "pipeline_2"),
                      (ConfigError, r"model.remat='offload_qkv' with model.pipeline.stages=2"))
  check_cell("dense", "pipeline_2", "none")


# Greedy decode (prefill, then the cache one token at a time) on a (2, 4) mesh with the 2d rules
# (cache rows over data, heads and MLP over model) gives the tokens of one device recomputing the
# whole forward at each step (no cache): the sinks in every step's softmax, the window and chunk
# masks and the NoPE temperature at the cache's positions, the soft-caps, the MLA latent cache,
# the routers with their biases. Prompts of 3 to 13 tokens and 12 new ones outrun the window (5)
# and the chunk (8).
DECODE_CELLS = ["sinks_window", "chunk_nope", "gemma", "deepseek", "moe_gpt_oss"]


@pytest.mark.parametrize("model", [m if i == 0 else pytest.param(m, marks=pytest.mark.slow)
                                   for i, m in enumerate(DECODE_CELLS)])
def test_decode_cell_equals_one_device(model):
  from shardax.trainer import decode
  params = reference(model, "none")[0]
  params = jax.tree.map(lambda a: a * 2.0, params)   # sharp attention: the tokens depend on the context
  prompts = [np.arange(1, n + 1, dtype=np.int32) * 7 % 255 + 1 for n in (3, 13, 9, 6)]
  ids = {}
  for ici, axes, preset, cache in (((1,), ("data",), "dp", False), ((2, 4), ("data", "model"), "2d", True)):
    exp = experiment(model, "none", ici, axes, preset)
    setup = setup_for(exp, jax.devices()[:int(np.prod(ici))])
    gen = decode.Generator(exp.model, jax.device_put(params, setup.shardings["params"]), setup.mesh, setup.rules,
                           use_cache=cache)
    ids[cache] = np.asarray(gen.run(prompts, decode.Sampling(max_new_tokens=12)).ids)
  np.testing.assert_array_equal(ids[True], ids[False], err_msg=model)
  assert len({tuple(r) for r in ids[False].tolist()}) > 1
