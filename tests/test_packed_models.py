"""Packed text through every LM: the MoE LM and the pipelined LM (plain and circular, on a
(stage x data) mesh) give a packed batch the loss of its documents read one at a time.

A packed row holds several documents; with their segment ids attention never crosses
from one to the next, per-document positions restart the rotary angles, and the loss
mask drops the padding. So the packed loss is the token-weighted mean of each
document's loss alone. Each case also shows that the packed batch would catch a model
that let attention cross documents (the loss without segment ids is far off).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax import configs, pipeline
from shardax.configs.moe import MoEConfig
from shardax.configs.schema import TransformerConfig
from shardax.layers.transformer import TransformerLM
from shardax.sharding import use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from shardax.trainer.data import packing
from meshtools import loss_and_grads, setup_for
from test_layers import TINY, random_state
from test_packing import DOC_LENGTHS, EOS, SEQ, documents


def alone_and_weights(loss_fn, docs):
  """(each document's loss read alone, its target count) with `loss_fn(batch) -> loss`."""
  losses = [float(loss_fn({k: jnp.asarray(v)[None] for k, v in packing.document_example(d, EOS).items()}))
            for d in docs]
  return losses, [len(d) + 1 for d in docs]


# ---------------------------------------------------------------- MoE LM

MOE_DISPATCHES = {
    # Routing that depends on a token alone: both top-2 experts always ('all') and a
    # capacity of the whole group (E/2 x 2S / E = S), so no token is dropped whatever else
    # shares its group.
    "capacity": dict(num_experts=4, d_ff=32, every=2, capacity_factor=2.0, second_expert="all"),
    # Dropless (DeepSeek-V3-like: sigmoid top-3 of 8, renormalized, scaled, one shared
    # expert, a balance bias that changes the choices): a token's experts depend on it
    # alone and no token is ever dropped, so nothing else in the row can move its loss.
    # Seen failing with the dispatch mixing 0.1x the batch's mean token into each token.
    "dropless": dict(num_experts=8, d_ff=16, every=2, top_k=3, score="sigmoid", gate_scale=2.5,
                     num_shared_experts=1, bias_update_rate=1e-3, dispatch="dropless"),
}


def moe_config(scan_layers: bool, dispatch: str = "capacity") -> TransformerConfig:
  """A tiny MoE LM whose routing depends on each token alone; no balance loss (a statistic
  of the whole group)."""
  return dataclasses.replace(TINY, scan_layers=scan_layers,
                             moe=MoEConfig(aux_loss_weight=0.0, **MOE_DISPATCHES[dispatch]))


@pytest.mark.parametrize("scan_layers,dispatch", [(True, "capacity"), (False, "capacity"),
                                                  (True, "dropless"), (False, "dropless")])
def test_moe_packed_loss_is_the_token_weighted_mean_of_each_document_alone(scan_layers, dispatch):
  cfg = moe_config(scan_layers, dispatch)
  graphdef, state = random_state(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
  train = jax.jit(lambda s, b: nnx.merge(graphdef, s).loss_and_metrics(b))
  evaluate = jax.jit(lambda s, b: nnx.merge(graphdef, s).eval_loss(b))
  docs = documents()
  packed = {k: jnp.asarray(v) for k, v in packing.pack_documents(docs, SEQ, EOS).items()}
  assert packed["loss_mask"].min() == 0  # the batch has padding
  alone, weights = alone_and_weights(lambda b: train(state, b)[0], docs)
  want = np.average(alone, weights=weights)
  loss, metrics = train(state, packed)
  assert float(metrics["loss_weight"]) == sum(weights) == sum(DOC_LENGTHS) + len(DOC_LENGTHS)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  np.testing.assert_allclose(float(metrics["ce_loss"]), want, rtol=2e-5)
  eval_loss, eval_metrics = evaluate(state, packed)
  np.testing.assert_allclose(float(eval_loss), want, rtol=2e-5)
  assert float(eval_metrics["loss_weight"]) == sum(weights)
  # Attention across documents (no segment ids) gives another loss: the batch can tell.
  crossing, _ = train(state, {k: v for k, v in packed.items() if k != "segment_ids"})
  assert abs(float(crossing) - want) > 1e-3


# ---------------------------------------------------------------- pipelined LM

ROWS, LAYERS = 8, 4
# name: (stages, microbatches, repeats, mesh ici, mesh axes, preset)
PIPELINES = {
    "S2_M2_R1_stage2xdata4": (2, 2, 1, (2, 4), ("stage", "data"), "pp_dp"),
    "S2_M4_R2_stage2xdata2xmodel2": (2, 4, 2, (2, 2, 2), ("stage", "data", "model"), "pp_tp"),
}


def lm_experiment(stages=1, micro=1, repeats=1, ici=(1, 1), axes=("data", "model"), preset="dp"):
  """A tiny LM on packed text (the default data source: batches carry segment ids,
  positions and a loss mask); built only, no data is read."""
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      f"model.num_layers={LAYERS}", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
      f"model.max_len={SEQ}", f"data.seq_len={SEQ}", f"train.global_batch={ROWS}",
      f"model.pipeline.stages={stages}", f"model.pipeline.microbatches={micro}",
      f"model.pipeline.circular_repeats={repeats}",
      f"sharding.preset={preset!r}", f"mesh.ici={ici!r}", f"mesh.axes={axes!r}"])
  return configs.build(cfg)


# Example lengths (ids + 1) per window of 16: the packer fills windows in order and would
# continue a document in the next window, so these fill each window exactly (1 to 3
# documents a row, no document split) and leave padding in the last row alone.
ROW_EXAMPLES = ((6, 10), (4, 8, 4), (16,), (3, 5, 8), (2, 14), (7, 9), (5, 5, 6), (11,))


def packed_rows(seed=1):
  """(documents, ROWS packed windows of them): microbatches (every M-th row) hold
  different layouts of documents."""
  rng = np.random.default_rng(seed)
  docs = [rng.integers(1, TINY.vocab_size, n - 1).astype(np.int32)
          for row in ROW_EXAMPLES for n in row]
  w = packing.pack_documents(docs, SEQ, EOS)
  assert w["inputs"].shape == (ROWS, SEQ)
  assert list(w["segment_ids"].max(1)) == [len(row) for row in ROW_EXAMPLES]  # none split
  return docs, w


@pytest.fixture(scope="module")
def unpipelined():
  """One device, no pipeline: params, a packed batch, its loss and grads, and the
  token-weighted mean of its documents' losses alone."""
  setup = setup_for(lm_experiment(), jax.devices()[:1])
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  docs, batch = packed_rows()
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    loss_fn = jax.jit(lambda b: step_lib.loss_fn(setup)(params, b)[0])
    alone, weights = alone_and_weights(loss_fn, docs)
    crossing = float(loss_fn({k: v for k, v in batch.items() if k != "segment_ids"}))
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  assert float(metrics["loss_weight"]) == sum(weights)
  want = np.average(alone, weights=weights)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  assert abs(crossing - want) > 1e-3  # attention across documents would show
  return jax.device_get(params), batch, want, jax.device_get(grads)


@pytest.mark.parametrize("case", list(PIPELINES))
def test_pipelined_packed_loss_is_the_token_weighted_mean_of_each_document_alone(case, unpipelined):
  stages, micro, repeats, ici, axes, preset = PIPELINES[case]
  ref_params, batch, want, ref_grads = unpipelined
  setup = setup_for(lm_experiment(stages, micro, repeats, ici, axes, preset))
  assert dict(setup.mesh.shape)["stage"] == stages and dict(setup.mesh.shape)["data"] > 1
  params = dict(ref_params, layers=pipeline.stage_params(ref_params["layers"], stages, repeats))
  (loss, grads, metrics), _ = loss_and_grads(setup, params, batch)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5, err_msg=case)
  assert float(metrics["loss_weight"]) == float(batch["loss_mask"].sum())
  grads = jax.device_get(grads)
  grads["layers"] = pipeline.unstage_params(grads["layers"], repeats)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6, err_msg=case)
