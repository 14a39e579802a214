"""Multi-token prediction (configs/mtp.py, layers/mtp.py; DeepSeek-V3 arXiv 2412.19437 section 2.2).

- The trainer's loss with MTP equals the paper's equations evaluated by hand in this file (numpy,
  float64) from the model's own params on a packed batch: main cross entropy + lambda / D x the
  sum over depths k of CE_k, where depth k combines RMSNorm(h^{k-1}) with RMSNorm(Emb(t_{i+k})),
  runs its transformer block and predicts t_{i+k+1} through the shared head; positions past the
  end or whose t_{i+k} lies in the next document predict nothing.
- Sharded (FSDP, 2D, expert parallel, ring context parallelism) equals one device, loss and
  grads, on a DeepSeek-V3-shaped model (MLA, group-limited sigmoid MoE with a selection bias and
  a shared expert, a first dense layer) with an MTP depth (an MoE block with MLA).
- The main logits, the eval loss and greedy decoding with MTP are those of the model without it.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from meshtools import loss_and_grads, packed_batch, setup_for, tiny_lm  # noqa: E402
from test_mla import compiled_forward_flops  # noqa: E402

from shardax import configs  # noqa: E402
from shardax.configs.schema import ConfigError  # noqa: E402
from shardax.sharding import use_rules  # noqa: E402
from shardax.trainer import decode  # noqa: E402
from shardax.trainer import state as state_lib  # noqa: E402
from shardax.trainer import step as step_lib  # noqa: E402

PACKED = ["data.source='stdlib'"]   # batches carry segment ids, positions and a loss mask
MTP2 = ["model.mtp.depth=2", "model.mtp.loss_weight=0.3"]
MTP1 = ["model.mtp.depth=1", "model.mtp.loss_weight=0.3"]
EPS = 1e-6


# ---- the paper's equations, by hand ----------------------------------------------------------

def rms(x, w):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * w


def rope(x, pos, theta):
  """Rotate-half RoPE of x [b, l, h, d] at positions [b, l]."""
  half = x.shape[-1] // 2
  angle = pos[..., None, None] * theta ** (-np.arange(half) * 2.0 / x.shape[-1])
  a, b = x[..., :half], x[..., half:]
  return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)


def block(p, x, pos, seg, theta):
  """A pre-norm decoder block: causal attention within each document, then the gated SiLU MLP."""
  h = rms(x, p["attn_norm"]["scale"])
  q, k, v = (np.einsum("bld,dhk->blhk", h, p["attn"][n]["kernel"]) for n in ("query", "key", "value"))
  q, k = rope(q, pos, theta), rope(k, pos, theta)
  scores = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
  l = x.shape[1]
  allowed = np.tril(np.ones((l, l), bool))[None] & (seg[:, :, None] == seg[:, None, :])
  scores = np.where(allowed[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  x = x + np.einsum("blhk,hkd->bld", np.einsum("bhqs,bshk->bqhk", probs, v), p["attn"]["out"]["kernel"])
  h = rms(x, p["mlp_norm"]["scale"])
  gate, up = h @ p["mlp"]["gate"]["kernel"], h @ p["mlp"]["up"]["kernel"]
  return x + (gate / (1 + np.exp(-gate)) * up) @ p["mlp"]["down"]["kernel"]


def mean_ce(logits, targets, keep):
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return -(picked * keep).sum() / keep.sum()


def loss_by_hand(params, batch, t):
  """(main CE, [CE_k for k = 1..D], the loss) of the paper's equations for a dense, tied,
  scanned lm.tiny with `t.mtp`."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  table = p["embed"]["embedding"]
  emb = lambda tokens: table[tokens] * np.sqrt(t.d_model)             # scale_embedding
  head = lambda x, w: rms(x, w) @ table.T                              # tied output head
  b, l = batch["inputs"].shape
  plain = np.broadcast_to(np.arange(l), (b, l))      # an unpacked batch: one document a row, all kept
  pos, seg = batch.get("positions", plain), batch.get("segment_ids", np.zeros((b, l), np.int64))
  loss_mask = batch.get("loss_mask", np.ones((b, l)))
  x = emb(batch["inputs"])
  for i in range(t.num_layers):
    x = block(jax.tree.map(lambda a: a[i], p["layers"]["blocks"]), x, pos, seg, t.rope_theta)
  main = mean_ce(head(x, p["final_norm"]["scale"]), batch["targets"], loss_mask)
  h = rms(x, p["final_norm"]["scale"])                                 # h^0: what the main head reads
  ces = []
  for k in range(1, t.mtp.depth + 1):
    m = p["mtp"][k - 1]
    nxt = np.zeros((b, l), np.int64)       # t_{i+k}: the input k positions on
    tgt = np.zeros((b, l), np.int64)       # t_{i+k+1}: its target
    keep = np.zeros((b, l))
    for r in range(b):
      for i in range(l - k):
        nxt[r, i], tgt[r, i] = batch["inputs"][r, i + k], batch["targets"][r, i + k]
        keep[r, i] = float(seg[r, i + k] == seg[r, i]) * loss_mask[r, i + k]
    merged = np.concatenate([rms(emb(nxt), m["enorm"]["scale"]), rms(h, m["hnorm"]["scale"])], -1)
    h = block(m["block"], merged @ m["eh_proj"]["kernel"].reshape(2 * t.d_model, t.d_model), pos, seg, t.rope_theta)
    ces.append(mean_ce(head(h, m["head_norm"]["scale"]), tgt, keep))
  return main, ces, main + t.mtp.loss_weight / t.mtp.depth * sum(ces)


@pytest.fixture(scope="module", params=["packed", "plain"])
def dense(request):
  """A dense lm.tiny with two MTP depths, its params and a batch: packed (3 documents a row, the
  last row padded) or plain (inputs and targets only: every position past L - k masked by that)."""
  source = PACKED if request.param == "packed" else ["data.source='synthetic'"]
  exp = tiny_lm(2, 4, ici=(1, 1), extra=source + MTP2)
  setup = setup_for(exp, jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  rng = np.random.default_rng(2)   # norm scales away from 1, so each norm's place shows
  params = jax.tree.map(lambda a: (a * (1 + 0.3 * rng.standard_normal(a.shape))).astype(a.dtype), params)
  batch = packed_batch(np.random.default_rng(1), 4, 16)
  if request.param == "plain":
    batch = {k: batch[k] for k in ("inputs", "targets")}
  return setup, params, batch


def test_loss_is_the_papers_equations_by_hand(dense):
  setup, params, batch = dense
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  main, ces, want = loss_by_hand(params, batch, setup.exp.model)
  assert float(metrics["ce_loss"]) == pytest.approx(main, rel=1e-5)
  for k, ce in enumerate(ces, start=1):
    assert float(metrics[f"mtp/loss_{k}"]) == pytest.approx(ce, rel=1e-5), k
  assert float(loss) == pytest.approx(want, rel=1e-5)
  assert abs(ces[0] - ces[1]) > 1e-3   # the depths see different inputs and targets
  for k in range(2):                   # every MTP param trains
    assert all(float(np.abs(g).max()) > 0 for g in jax.tree.leaves(grads["mtp"][k])), k


def eval_flops(setup) -> float:
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    compiled = jax.jit(lambda p, x: step_lib.eval_loss_fn(setup)(p, x)[0]).lower(
        setup.abstract["params"], step_lib.abstract_batch(setup)).compile()
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


def test_evaluation_reports_the_main_loss_and_runs_no_mtp(dense):
  """Evaluation reports the main cross entropy only, and its compiled program does the work of
  the model without MTP (the modules are not run and thrown away: not run at all)."""
  setup, params, batch = dense
  main, _, _ = loss_by_hand(params, batch, setup.exp.model)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    value, _ = jax.jit(step_lib.eval_loss_fn(setup))(params, batch)
  assert float(value) == pytest.approx(main, rel=1e-5)
  off = setup_for(_without_mtp(setup.exp), jax.devices()[:1])
  assert eval_flops(setup) == eval_flops(off)


def _without_mtp(exp):
  import dataclasses
  return dataclasses.replace(exp, model=dataclasses.replace(exp.model, mtp=None))


def test_param_and_flop_counts_are_what_the_mtp_modules_run(dense):
  """configs/flops.py: mtp_params is the modules' params; the forward FLOPs the compiler counts
  for two depths (the loss with them less the loss without) are the formula's (training / 3) plus
  what it leaves out: the causally masked half of each block's scores (the XLA path computes the
  square) and each depth's embedding lookup (a one-hot matmul on CPU). --mode=explain says both."""
  from shardax.configs import flops
  from shardax.trainer import explain
  setup, params, _ = dense
  t, s, b = setup.exp.model, setup.exp.data.seq_len, setup.exp.train.global_batch
  mtp = sum(np.size(a) for a in jax.tree.leaves(params["mtp"]))
  assert flops.mtp_params(t) == mtp and t.param_count() == sum(np.size(a) for a in jax.tree.leaves(params))
  counted = compiled_forward_flops(setup.exp) - compiled_forward_flops(_without_mtp(setup.exp))
  depth = t.mtp.depth
  masked_half = depth * s * t.num_heads * 2 * t.dim_per_head * b * s
  lookup = depth * 2 * b * s * t.vocab_size * t.d_model
  model_flops = flops.per_token(t, s) - flops.per_token(_without_mtp(setup.exp).model, s)   # what MFU counts
  assert model_flops == flops.mtp_flops_per_token(t, s) > 0
  ratio = counted / (model_flops * s * b / 3 + masked_half + lookup)
  assert 1.0 <= ratio <= 1.10, (counted, ratio)
  line = explain.mtp_line(t, s)
  assert line.startswith(f"multi-token prediction: 2 module(s), {mtp:,} params ("), line


def test_fp8_delayed_scaling_reaches_the_mtp_projections():
  """model.quantization reaches the MTP modules: with fp8 delayed scaling eh_proj and the
  block's projections carry amax histories, and the step's next history of each holds this
  step's amax (what the train step writes over the params)."""
  from shardax.layers import quantization
  exp = tiny_lm(2, 4, ici=(1, 1), extra=PACKED + MTP2 + ["model.quantization='fp8_delayed'"])
  setup = setup_for(exp, jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  (_, grads, _), _ = loss_and_grads(setup, params, packed_batch(np.random.default_rng(1), 4, 16))
  _, written = quantization.take_histories(jax.device_get(grads))
  for k in range(2):
    for layer in (written["mtp"][k]["eh_proj"], written["mtp"][k]["block"]["attn"]["query"],
                  written["mtp"][k]["block"]["mlp"]["down"]):
      assert float(np.asarray(layer[quantization.HISTORY])[:, 0].min()) > 0, k


# ---- DeepSeek-V3-shaped: sharded == one device -------------------------------------------------

V3 = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=16", "model.mla.qk_nope_head_dim=8",
      "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6",
      "model.scale_embedding=False", "model.tied_embedding=False",
      "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.d_ff=32", "model.moe.every=1",
      "model.moe.first_dense_layers=1", "model.moe.num_shared_experts=1", "model.moe.score='sigmoid'",
      "model.moe.n_group=4", "model.moe.topk_group=2", "model.moe.bias_update_rate=1e-3",
      "model.moe.gate_scale=2.5", "model.moe.dispatch='dropless'", "model.moe.aux_loss_weight=0.01"]


def v3_tiny(ici=(1, 1), axes=("data", "model"), preset="dp", extra=()):
  return tiny_lm(2, 8, ici=ici, axes=axes, preset=preset, extra=V3 + PACKED + MTP1 + list(extra))


@pytest.fixture(scope="module")
def v3_reference():
  setup = setup_for(v3_tiny(), jax.devices()[:1])
  params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  batch = packed_batch(np.random.default_rng(0), 8, 16)
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  return params, batch, float(loss), jax.device_get(grads), metrics


def test_v3_shaped_param_count_and_metrics(v3_reference):
  params, _, loss, grads, metrics = v3_reference
  t = v3_tiny().model
  assert t.param_count() == sum(np.size(a) for a in jax.tree.leaves(params))
  assert "moe" in params["mtp"][0]["block"] and "kv_up" in params["mtp"][0]["block"]["attn"]
  assert {"mtp/loss_1", "mtp/aux_loss", "ce_loss"} <= set(metrics) and "mtp/loss_2" not in metrics
  assert loss == pytest.approx(float(metrics["ce_loss"]) + 0.3 * float(metrics["mtp/loss_1"])
                               + 0.01 * (float(metrics["moe/aux_loss"]) + float(metrics["mtp/aux_loss"])), rel=1e-6)
  # the MTP blocks' balance biases are written back by the step like the stack's
  assert float(np.abs(metrics[step_lib.STATE_UPDATES]["mtp"][0]["block"]["moe"]["balance_bias"]).max()) > 0


@pytest.mark.parametrize("ici,axes,preset,extra", [
    ((8, 1), ("data", "model"), "fsdp", []),
    ((2, 4), ("data", "model"), "2d", []),
    ((2, 4), ("data", "expert"), "expert_axis", []),
    ((2, 4), ("data", "context"), "dp_cp", ["model.context_parallel='ring'"]),
], ids=["fsdp", "2d", "expert", "ring_cp"])
def test_v3_shaped_sharded_equals_one_device(v3_reference, ici, axes, preset, extra):
  params, batch, ref_loss, ref_grads, _ = v3_reference
  setup = setup_for(v3_tiny(ici, axes, preset, extra))
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def test_remat_and_unscanned_stack_equal_the_reference(v3_reference):
  params, batch, ref_loss, ref_grads, _ = v3_reference
  setup = setup_for(v3_tiny(extra=["model.remat='full'"]), jax.devices()[:1])
  (loss, grads, _), _ = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


# ---- MTP changes nothing the main model computes ------------------------------------------------

def test_main_logits_and_greedy_decode_equal_the_model_without_mtp(v3_reference):
  """Same main params (the MTP modules are built last, so the rest is drawn identically), the
  same logits and the same greedy tokens."""
  params, batch, _, _, _ = v3_reference
  on = setup_for(v3_tiny(), jax.devices()[:1])
  off = setup_for(v3_tiny(extra=["model.mtp=None"]), jax.devices()[:1])
  assert off.exp.model.mtp is None
  main = {k: v for k, v in params.items() if k != "mtp"}
  drawn = jax.device_get(state_lib.init_fn(off)(jax.random.key(0))["params"])
  assert jax.tree.structure(drawn) == jax.tree.structure(main)
  for a, b in zip(jax.tree.leaves(drawn), jax.tree.leaves(main)):
    np.testing.assert_array_equal(a, b)
  rng = np.random.default_rng(3)   # norm scales away from 1: a main norm swapped for an MTP one shows
  params = jax.tree.map(lambda a: (a * (1 + 0.3 * rng.standard_normal(a.shape))).astype(a.dtype), params)
  main = {k: v for k, v in params.items() if k != "mtp"}
  tokens = jnp.asarray(batch["inputs"])
  logits, ids = {}, {}
  prompts = [batch["inputs"][0, :5].tolist(), batch["inputs"][1, :9].tolist()]
  for name, setup, p in (("on", on, params), ("off", off, main)):
    with jax.set_mesh(setup.mesh), use_rules(setup.rules):
      logits[name] = np.asarray(jax.jit(lambda q, x: setup.model(q)(x))(p, tokens))
    result = decode.Generator(setup.exp.model, p, setup.mesh, setup.rules).run(
        prompts, decode.Sampling(max_new_tokens=6))
    ids[name] = [result.ids[j][:result.counts[j]].tolist() for j in range(2)]
  np.testing.assert_array_equal(logits["on"], logits["off"])
  assert ids["on"] == ids["off"]


@pytest.mark.parametrize("override, field", [
    ("model.mtp.depth=0", "model.mtp.depth"),
    ("model.mtp.loss_weight=-1.0", "model.mtp.loss_weight"),
    ("model.pipeline.stages=2", "model.pipeline.stages"),
    ("model.layer_pattern=({'window': 4}, {})", "model.layer_pattern"),
])
def test_config_errors_name_the_field(override, field):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, ["model.mtp.depth=1", "model.num_layers=2", override])
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    configs.build(cfg)
