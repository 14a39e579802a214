"""MoE decoding drops no token copy, whatever the training layout bets on balance.

Training may bet on balance (a dropless exchange's `expert_buffer` below the no-overflow
bound with `expert_overflow='drop'`, as moe.deepseek_v3 registers it; a capacity factor);
decoding runs every dispatch at its no-overflow bound (`TransformerConfig.for_decode`), so
expert-parallel greedy decode is one device's, token for token. The routers here are skewed
(a balance bias towards the experts of one shard) so that the training config does drop
copies on the same prompts: the tests assert that first, so they cannot pass vacuously.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from shardax import models
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import decode
from shardax.trainer import state as state_lib
from test_decode import experiment, generator, params_of, prompts
from test_moe_dropless import emulated_ragged_all_to_all

NEW = 12
SHAPE = ["model.num_layers=3", "model.d_model=64", "model.num_heads=4", "model.d_ff=128",
         "model.max_len=64", "data.seq_len=32", "train.global_batch=8", "data.source='synthetic'"]
# moe.deepseek_tiny's router (sigmoid top-k, bias balancing, a shared expert, a first dense
# layer) at 8 experts top-2, trained with moe.deepseek_v3's bet: a 1.25 buffer that drops.
DEEPSEEK_BET = [*SHAPE, "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.d_ff=32",
                "model.moe.expert_buffer=1.25", "model.moe.expert_overflow='drop'"]
EXPERT_AXIS = ["sharding.preset='expert_axis'", "mesh.axes=('data', 'expert')"]
# Experts 0 and 1 (the first expert shard's, 4 shards of 2) get chosen more often than the rest.
SKEW = np.array([0.4, 0.4, 0, 0, 0, 0, 0, 0], np.float32)


def with_bias(params, bias_per_layer):
  """params with every MoE layer's balance bias set (the value bias balancing would reach)."""
  params = jax.tree.map(np.array, params)
  moe = params["layers"]["blocks"]["moe_block"]["moe"]
  moe["balance_bias"] = np.stack(bias_per_layer).astype(np.float32)
  return params


def dropped_in_training_forward(exp, params, batch):
  """The fraction of its token copies each MoE layer drops in the training config's forward
  over `batch` on exp's mesh."""
  setup = state_lib.create(exp, make_mesh(exp.mesh))
  graphdef = nnx.split(nnx.eval_shape(lambda: models.build(exp.model, nnx.Rngs(0))), nnx.Param, ...)[0]
  tokens, _ = decode.Generator(exp.model, params).padded(batch, NEW)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    stats = jax.jit(lambda p, t: nnx.merge(graphdef, p).forward(t, deterministic=True)[1])(
        jax.device_put(params, setup.shardings["params"]),
        jax.device_put(tokens, setup.batch_sharding["inputs"]))
  return np.asarray(stats["dropped_copies_count"]) / np.asarray(stats["routed_copies_count"])


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
def test_expert_parallel_decode_equals_one_device_whatever_the_training_bet(exchange, monkeypatch):
  """(data 2, expert 4), preset expert_axis, trained at expert_buffer=1.25 with 'drop': its
  forward over these prompts drops copies; decode equals one device's token for token.
  'ragged' (the TPU/GPU exchange moe.deepseek_v3 uses) runs with the collective emulated,
  as XLA:CPU has none (tests/test_moe_dropless.py)."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  bet = [*DEEPSEEK_BET, f"model.moe.expert_exchange={exchange!r}", *EXPERT_AXIS]
  sharded = experiment(*bet, "mesh.ici=(2, 4)", name="moe.deepseek_tiny")
  one = experiment(*bet, "mesh.ici=(1, 1)", name="moe.deepseek_tiny")
  params = with_bias(params_of(one), [SKEW, SKEW])
  batch = prompts()
  dropped = dropped_in_training_forward(sharded, params, batch)
  assert (dropped > 0.02).all(), dropped
  s = decode.Sampling(max_new_tokens=NEW)
  want = generator(one, params, jax.devices()[:1]).run(batch, s)
  got = generator(sharded, params).run(batch, s)
  np.testing.assert_array_equal(got.ids, want.ids)


def test_capacity_dispatch_decodes_as_one_device_whatever_its_capacity_factor():
  """GShard capacity dispatch trained at capacity_factor 0.25 in 2 dispatch pieces, experts
  over 8 devices (preset expert): its forward drops copies; decode (one group per sequence,
  capacity = group, one piece) equals one device's."""
  bet = [*SHAPE, "model.num_layers=2", "model.moe.d_ff=32", "model.moe.capacity_factor=0.25",
         "model.moe.min_capacity=4", "model.moe.dispatch_chunks=2", "sharding.preset='expert'"]
  sharded = experiment(*bet, "mesh.ici=(8,)", "mesh.axes=('data',)", name="moe.tiny")
  one = experiment(*bet, "mesh.ici=(1,)", "mesh.axes=('data',)", name="moe.tiny")
  params = params_of(one)
  batch = prompts()
  assert (dropped_in_training_forward(sharded, params, batch) > 0.1).all()
  s = decode.Sampling(max_new_tokens=NEW)
  want = generator(one, params, jax.devices()[:1]).run(batch, s)
  np.testing.assert_array_equal(generator(sharded, params).run(batch, s).ids, want.ids)


def test_a_dispatch_forced_below_the_bound_stops_decode_naming_the_layer(monkeypatch):
  """A decode config forced to expert_buffer=2.0 ('error': overflowing copies poison the
  output) on (data 2, expert 4). MoE layer 1 (unit 0) routes each token to experts 0 and 2,
  on two shards: one copy per shard fits 2.0 fair shares. MoE layer 2 (unit 1) routes each
  to experts 0 and 1, both on shard 0: half its copies do not fit, in the prefill and in a
  generate step. Both phases stop with an error naming layer 2 and the phase, not tokens
  argmaxed from NaN logits; at the bound `for_decode` sets, the same params decode."""
  exp = experiment(*DEEPSEEK_BET, *EXPERT_AXIS, "mesh.ici=(2, 4)", name="moe.deepseek_tiny")
  big = 10.0   # sigmoid scores are < 1: these experts win every token
  params = with_bias(params_of(exp), [np.eye(8)[0] * big + np.eye(8)[2] * big,
                                      np.eye(8)[0] * big + np.eye(8)[1] * big])
  batch = prompts()
  s = decode.Sampling(max_new_tokens=NEW)
  bound = generator(exp, params)
  assert bound.run(batch, s).steps == NEW
  tokens, lengths = bound.padded(batch, NEW)
  cache, logits = bound.prefill(tokens, lengths, NEW)

  def forced(cfg):
    cfg = cfg.for_decode()
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_buffer=2.0))
  monkeypatch.setattr(decode, "decode_config", forced)
  gen = generator(exp, params)
  assert gen.model_cfg.moe.expert_buffer == 2.0
  with pytest.raises(decode.DroppedCopiesError, match=r"decode \(prefill\): MoE layer 2 \(\d+ copies\) routed"):
    gen.run(batch, s)
  with pytest.raises(decode.DroppedCopiesError,
                     match=r"decode \(generate step 0\): MoE layer 2 \(8 copies\) .*expert_buffer=2.0"):
    gen.generate(cache, logits, lengths, s, tokens.shape[1])
