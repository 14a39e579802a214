"""Model options the published runs need: the plain (two-matrix) MLP and the parallel block;
and every LM option reaches MoE layers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardax.configs.moe import MoEConfig
from shardax.configs.schema import TransformerConfig
from shardax.layers import TransformerLM
from shardax.layers.transformer import Block
from shardax.perf import flops

CFG = TransformerConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=64, max_len=16,
                        mlp="plain", activation="relu", parallel_block=True, tied_embedding=False)


def test_parallel_block_adds_both_branches_of_one_norm():
  with nnx.use_eager_sharding(False):
    block = Block(CFG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  h = block.attn_norm(x)
  expected = x + block.attn(h, pos) + jax.nn.relu(h @ block.mlp.up.kernel[...]) @ block.mlp.down.kernel[...]
  np.testing.assert_allclose(block(x, pos)[0], expected, rtol=1e-5, atol=1e-5)
  assert block.mlp_norm is None


def test_plain_mlp_params_are_what_the_flop_count_assumes():
  with nnx.use_eager_sharding(False):
    model = TransformerLM(CFG, rngs=nnx.Rngs(0))
  total = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  norms = CFG.num_layers * CFG.d_model + CFG.d_model     # one norm per parallel block + final
  embed = CFG.vocab_size * CFG.d_model                   # the lookup table (the head is counted)
  assert flops.matmul_params(CFG) == total - norms - embed


MOE_CFG = dataclasses.replace(CFG, mlp="gated", activation="silu",
                              moe=MoEConfig(num_experts=4, d_ff=32, every=2, top_k=2, dispatch="dropless"))


def test_lm_options_reach_the_moe_layers():
  """The former MoE LM ignored model.z_loss and built its MoE blocks with two norms whatever
  model.parallel_block said; in the one decoder both reach MoE models."""
  with nnx.use_eager_sharding(False):
    model = TransformerLM(dataclasses.replace(MOE_CFG, z_loss=1e-2), rngs=nnx.Rngs(0))
  assert model.layers.blocks.moe_block.mlp_norm is None         # a parallel block, MoE FFN inside
  assert model.layers.blocks.moe_block.moe is not None and model.layers.blocks.dense[0].mlp_norm is None
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, 64)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  loss, metrics = jax.jit(lambda s, b: nnx.merge(graphdef, s).loss_and_metrics(b))(state, batch)
  m = MOE_CFG.moe
  want = metrics["ce_loss"] + 1e-2 * metrics["z_loss"] + m.aux_loss_weight * metrics["moe/aux_loss"]
  assert float(metrics["z_loss"]) > 1.0
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  assert MOE_CFG.param_count() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
