"""Multi-head latent attention under rematerialization and FSDP: the backward keeps MLA's
compact tensors (the low-rank query and the latent with its RoPE key), not the per-head
queries, keys and values expanded from them, and its up projections, which have no embed
dim, are split like every other weight.

The residuals are read from the vjp closure jax builds (its leaves are what the backward
keeps); the splits from the params' shardings as the trainer makes them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax import configs
from shardax.configs.mla import MLAConfig
from shardax.layers.blocks import REMAT_POLICIES
from shardax.layers.mla import MultiHeadLatentAttention
from shardax.sharding import rules as rules_lib
from shardax.trainer import model_setup
from meshtools import setup_for, tiny_lm

B, L, D_MODEL, HEADS = 2, 8, 32, 4
MLA = MLAConfig(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def residual_shapes(policy: str, mla: MLAConfig = MLA) -> tuple[list[tuple], jax.Array]:
  """The shapes of what the backward keeps for one MLA layer under `policy`, and its input
  gradient."""
  attn = MultiHeadLatentAttention(D_MODEL, HEADS, mla, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(attn)
  x = jax.random.normal(jax.random.key(1), (B, L, D_MODEL))

  def f(x):
    return nnx.merge(graphdef, params)(x)

  if policy != "none":
    f = jax.checkpoint(f, policy=REMAT_POLICIES[policy])
  out, vjp = jax.vjp(f, x)
  (dx,) = vjp(jnp.ones_like(out))
  param_shapes = {tuple(p.shape) for p in jax.tree.leaves(params)}
  kept = [tuple(a.shape) for a in jax.tree.leaves(vjp) if hasattr(a, "shape")]
  return [s for s in kept if s not in param_shapes], dx


@pytest.mark.parametrize("policy", ["moe_returned", "moe_matmuls"])
def test_remat_keeps_the_latents_not_the_expanded_heads(policy):
  """Kept: the low-rank query [b, l, q_lora_rank] and the latent with the RoPE key before
  their norm and rotation [b, l, kv_lora_rank + rope dims]; not q, k [b, l, n, p + e] nor
  v [b, l, n, v]. The gradient is the one without remat."""
  kept, dx = residual_shapes(policy)
  c, r, e = MLA.q_lora_rank, MLA.kv_lora_rank, MLA.qk_rope_head_dim
  assert (B, L, c) in kept and (B, L, r + e) in kept, kept
  per_head = {(B, L, HEADS, MLA.qk_head_dim), (B, L, HEADS, MLA.v_head_dim)}
  assert not per_head.intersection(kept), kept
  _, ref = residual_shapes("none")
  np.testing.assert_allclose(dx, ref, rtol=1e-5, atol=1e-6)


def test_without_a_low_rank_query_the_per_head_query_is_kept():
  """q_lora_rank=None (DeepSeek-V2-Lite): the query is one projection, kept as the standard
  attention's is; the keys and values still come from the kept latent."""
  kept, _ = residual_shapes("moe_returned", MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                                      qk_rope_head_dim=4, v_head_dim=6))
  assert (B, L, HEADS, MLA.qk_head_dim) in kept and (B, L, 16 + 4) in kept, kept
  assert (B, L, HEADS, MLA.v_head_dim) not in kept, kept


MLA_LM = ["model.mla.kv_lora_rank=16", "model.mla.q_lora_rank=16", "model.mla.qk_nope_head_dim=8",
          "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=6"]


@pytest.mark.parametrize("preset,ici,names", [
    ("fsdp", (8, 1), ("q_down", "q_up", "kv_down", "kv_up", "out")),
    ("2d", (2, 4), ("q_up", "kv_up", "out")),
])
def test_fsdp_presets_split_the_up_projections(preset, ici, names):
  """The query and key/value up projections [q_lora | kv_lora, heads, kv] have no embed dim:
  under the FSDP presets their rank dim goes over `data` (and under `2d` their heads over
  `model`), so each of the 8 devices holds 1/8 of them, as of the output projection."""
  setup = setup_for(tiny_lm(2, 8, ici=ici, preset=preset, extra=MLA_LM))
  kernels = {jax.tree_util.keystr(path): a for path, a in jax.tree_util.tree_leaves_with_path(setup.abstract_params)
             if "attn" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path)}
  for name in names:
    found = [(k, a) for k, a in kernels.items() if f"'{name}'" in k]
    assert found, (name, list(kernels))
    for key, a in found:
      shard = a.sharding.shard_shape(a.shape)
      assert np.prod(a.shape) == 8 * np.prod(shard), (key, a.shape, shard)


def test_deepseek_v3_splits_every_large_weight_over_all_its_chips():
  """moe.deepseek_v3's rules on its 16 x 64 mesh split every weight of a million elements or
  more over all 1024 chips: MLA's up projections too (their rank over `data`, heads over
  `expert`)."""
  exp = configs.build(configs.get("moe.deepseek_v3"))
  rules = rules_lib.resolve(exp.sharding.preset, exp.sharding.rules)
  mesh = dict(zip(exp.mesh.axes, exp.mesh.ici))
  _, params, axes = model_setup._abstract_params(exp.model)
  whole = []
  for (path, p), logical in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(
      axes, is_leaf=lambda a: isinstance(a, tuple))):
    spec = rules_lib.logical_to_spec(logical, rules, mesh, p.shape)
    ways = np.prod([mesh[a] for d in spec if d for a in ((d,) if isinstance(d, str) else d)])
    if np.prod(p.shape) >= 2**20 and ways != 1024:
      whole.append((jax.tree_util.keystr(path), p.shape, spec))
  assert not whole, whole
