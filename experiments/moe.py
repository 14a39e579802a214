"""Mixture-of-experts LMs: CPU defaults that train in minutes, and pod configurations.

The CPU ones run lm.tiny's run (experiments/recipes.py tiny_run) so their eval bits per byte
compare with lm.tiny's (docs/moe.md; the runs in docs/results/moe_convergence.md). They use
the "expert" sharding preset: experts split over the `data` axis that also splits the batch
(GShard), so the dispatch and combine become all-to-alls.

The pod ones are dry-run targets (`--mode=dry_run --shallow`; docs/moe.md has the table, the
step-by-step predictions are in docs/results/moe_pods.md): a published shape on recipes.pod_moe.
"""

import dataclasses

from shardax.configs import register, shapes
from shardax.configs.mtp import MTPConfig
from shardax.configs.schema import CheckpointConfig, ShardingConfig
from shardax.experiments import recipes
from shardax.sharding import MeshConfig, libtpu_flags

EXPERT = ShardingConfig(preset="expert")
# Multi-head latent attention's weights on the pod MoE rules (moe.deepseek_v3): the up projections
# [q_lora | kv_lora, heads, kv] have no embed dim, so their rank goes over `data` and their heads
# over `expert`; in a weight or activation whose embed or batch dim took those axes first, the
# rank and the heads stay whole.
MLA_WEIGHTS = (("q_lora", "data"), ("kv_lora", "data"), ("heads", "expert"))


@register("moe.tiny", "4-layer byte-level LM, 8-expert top-2 MoE FFN every 2nd layer; CPU, minutes")
def tiny():
  return recipes.tiny_run(recipes.model(shapes.MOE_TINY, moe=dict(capacity_factor=1.25)), sharding=EXPERT,
                          train=dataclasses.replace(recipes.TINY_TRAIN, steps=200, global_batch=16))


@register("moe.mixtral_tiny", "lm.tiny with every FFN a Mixtral MoE: top-2 of 8 experts (d_ff 256), "
          "renormalized softmax gates, dropless; lm.tiny's active FLOPs per token; CPU, minutes")
def mixtral_tiny():
  """Each token goes through 2 experts of d_ff 256: lm.tiny's FFN width 512 in active FLOPs
  (plus the 192 x 8 router), with 4x the FFN parameters. Learning rate 2e-3, not lm.tiny's
  3e-3: the rate at which it beats lm.tiny (docs/moe.md, "Learning rate")."""
  return recipes.tiny_run(recipes.model(shapes.MIXTRAL_TINY, moe=dict(dispatch="dropless")),
                          learning_rate=2e-3, sharding=EXPERT)


@register("moe.deepseek_tiny", "lm.tiny as a DeepSeek-V3-style MoE: layer 1 dense, then 32 fine-grained "
          "experts (d_ff 64), sigmoid top-7 (gates x2.5) + 1 shared expert, bias balancing; lm.tiny's active FLOPs")
def deepseek_tiny():
  """Active FFN per token: 7 routed + 1 shared expert of d_ff 64 = lm.tiny's 512. Balance:
  DeepSeek-V3's auxiliary-loss-free bias (rate 1e-3 per step) and a tiny balance loss (its
  sequence-wise alpha, 1e-4). The gates' x2.5 (V3's routed_scaling_factor) keeps each routed
  expert's output near the shared one's, so the routed experts learn as fast (docs/moe.md).
  Learning rate 2e-3, as mixtral_tiny."""
  return recipes.tiny_run(shapes.DEEPSEEK_TINY, learning_rate=2e-3, sharding=EXPERT)


@register("moe.gshard_1t", "GShard-scale top-2 MoE LM: 2048 experts, 40 layers, ~1.03T params, TPUv3-2048")
def gshard_1t():
  """configs/shapes.py GSHARD_1T. One expert per TPUv3 core (v3:32x32 = 2048 cores), groups of
  2048 tokens (2 sequences) per core, capacity max(4, ceil(2.0 x 2 x 2048 / 2048)) = 4.
  Adafactor, as GShard trained it, each expert's matrix factored on its own
  (docs/results/pod_table.md has the memory against AdamW). Built abstractly by dry runs; not
  meant to be compiled on a CPU host."""
  return recipes.on_pod(recipes.model(shapes.GSHARD_1T, moe=dict(group_size=2048), **recipes.POD_STEP),
                        seq_len=1024, global_batch=4096, mesh=MeshConfig(ici=(-1, 1), topology="v3:32x32"),
                        sharding=EXPERT, optimizer=dataclasses.replace(recipes.ADAFACTOR, warmup_steps=10_000),
                        checkpoint=CheckpointConfig(every=1000))


@register("moe.mixtral_8x7b", "Mixtral-8x7B-shaped MoE LM (46.7B params, 12.9B active): 32 layers, "
          "top-2 of 8 experts, dropless; TPU v5p-256 (128 chips, FSDP, all experts on every chip)")
def mixtral_8x7b():
  """MaxText's layout for it: no expert parallelism. Every chip runs all 8 experts on its own
  tokens (no all-to-all, no receive buffer), the expert weights FSDP-split over all 128 chips
  and gathered per layer like a dense FFN's, over two mesh axes (the 4x4 plane, the 8-chip dim)
  so the gathers are all-gathers and reduce-scatters one axis at a time (docs/results/moe_pods.md); megablox
  kernels, whose weight gradient visits only filled row tiles; the splash kernel. remat
  'moe_matmuls' spends the HBM left over on each layer's expert matmul outputs and attention
  projections, so the backward recomputes neither."""
  return recipes.every_expert_on_every_chip(shapes.MIXTRAL_8X7B, remat="moe_matmuls")


@register("moe.deepseek_v3", "DeepSeek-V3 (671B params): 61 layers (3 dense), multi-head latent attention, "
          "256 fine-grained experts top-8 in 4 of 8 groups + 1 shared, sigmoid gates x2.5, bias balancing, "
          "YaRN, 1 multi-token prediction module; TPU v5p-2048")
def deepseek_v3():
  """configs/shapes.py DEEPSEEK_V3 (the published config.json) with its one multi-token
  prediction module (loss weight 0.3, the paper's for its first 10T tokens) on 1024 chips: 16 data x 64 expert, the experts over an 8 x 8 plane of
  the torus (both closed rings: fewer hops for an all-to-all than the 8 x 16 one;
  perf/links.py), four per chip and layer, their weights FSDP-split over `data`; every other
  weight FSDP-split over all 1024 chips, MLA's up projections [q_lora | kv_lora, heads, kv]
  (no embed dim) by their rank over `data` and their heads over `expert` (MLA_WEIGHTS). What
  each step setting buys is in docs/moe.md, the dry runs in docs/results/moe_pods.md:
    * the ragged exchange: only the rows that go travel, into a receive buffer of 1.25 fair
      shares of what the expert group sends (copies past it dropped and logged as
      moe/dropped_copies; benchmarks/moe_drops.py measures how many, on a trained router and
      over a run from step 0, and the dry run prints the latter beside the bet);
    * the splash kernel (`attention='flash'`): no [batch, heads, S, S] scores;
    * remat 'moe_returned': kept for the backward are MLA's compact tensors (the low-rank
      query [b, l, 1536], the latent with the RoPE key [b, l, 576]) and its output
      projection, the expert gate/up outputs and the returned expert outputs; recomputed are
      the per-head queries, keys and values (the two up projections, under 3% of a layer's
      training FLOPs, instead of keeping 0.5 GB a layer per chip) and the dispatch exchange, but no
      expert matmul;
    * fp8 dispatch, as DeepSeek-V3: what travels to the experts goes in fp8, what comes back
      in bf16.
  Memory: what the backward keeps is about 0.88 GiB per MoE layer and chip (the returned
  outputs 0.44, the gate/up outputs 0.31, the layer input and output projection 0.11, MLA's
  compact tensors 0.02), about 51 GiB over the 58 MoE layers; with the head's
  whole-vocabulary gradients (main and MTP) the full compile asks 73.6 GiB of the 95.74 GiB a
  v5p chip allows. `--shallow` overstates this model's memory (its 6- and 7-layer copies grow
  1.45 GB a MoE layer): price it with the full compile (docs/results/moe_pods.md)."""
  moe = {**recipes.PADDED_EXCHANGE, "expert_exchange": "ragged", "expert_buffer": 1.25, "fp8_dispatch": True}
  return recipes.pod_moe(
      shapes.DEEPSEEK_V3, global_batch=1024, moe=moe,
      step=dict(attention="flash", remat="moe_returned", mtp=MTPConfig(depth=1, loss_weight=0.3)),
      rules=recipes.POD_MOE_RULES + MLA_WEIGHTS,
      mesh=MeshConfig(topology="v5p:8x8x16", ici=(16, 64), axes=("data", "expert"),
                      libtpu_flags=libtpu_flags.ASYNC_ALL_TO_ALL))
