"""Pod experiments of the published model families shardax imports from Hugging Face
(models/hf/), at their published shapes (configs/shapes.py): dry-run targets
(`--mode=dry_run [--shallow]`) on a real TPU topology, on the MoE pod recipe
(experiments/recipes.py pod_moe) or, for a dense model, FSDP (recipes.on_pod).
"""

import dataclasses

from shardax.configs import register, shapes
from shardax.configs.attention import LayerKind
from shardax.configs.moe import MoEConfig
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import ShardingConfig, TransformerConfig
from shardax.experiments import recipes
from shardax.sharding import MeshConfig, libtpu_flags


@register("moe.qwen3_235b", "Qwen3-235B-A22B as published (94 layers, 128 experts top-8, 22B active); "
          "TPU v5p-256 (128 chips, FSDP, all experts on every chip), dropless; a dry-run target")
def qwen3_235b():
  """configs/shapes.py QWEN3_235B on v5p:4x4x8 at 256 x 4096 tokens a step, moe.mixtral_8x7b's
  layout: no expert parallelism, so nothing is exchanged and nothing can drop (Qwen3 trains
  dropless). Every chip runs all 128 experts on its own tokens (megablox kernels), every weight
  FSDP-split over all 128 chips along (data 16, fsdp 8) and gathered per layer, with the async
  collective fusion flags; the splash kernel, bf16 weights, Adafactor, remat 'full'
  ('moe_matmuls' asks ~281 GiB a chip). Expert parallelism over the 8-chip ring (16 data x 8
  expert, padded exchange at the no-overflow bound) fits too but moves its fixed blocks of 8
  fair shares: a 5x slower step in the dry run."""
  return recipes.every_expert_on_every_chip(shapes.QWEN3_235B, remat="full")


@register("moe.llama4_maverick", "Llama-4-Maverick-17B-128E as published (48 layers, 128 experts top-1 + a "
          "shared expert every 2nd layer, NoPE every 4th, 400B params); TPU v5p-256 (128 chips: 16 data x 8 "
          "expert), dropless; a dry-run target")
def llama4_maverick():
  """configs/shapes.py MAVERICK (the published text model: chunked-RoPE and NoPE layers, the
  sigmoid top-1 gate on the expert's input) on v5p:4x4x8 at 256 x 4096 tokens a step: the 128
  experts split 8 ways over the torus' 8-chip ring (16 a chip, their weights FSDP-split over the
  16-way `data`), the tokens over both axes. Dropless at the no-overflow bound (for top-1 of 128
  on 8 expert shards: 8 fair shares), so no routing drops a copy; fixed blocks exchanged in 2
  async pieces (recipes.PADDED_EXCHANGE's exchange), megablox matmuls, the splash kernel (4096
  tokens fit in one 8192-token chunk), bf16 weights, Adafactor, remat 'full'."""
  moe = {**recipes.PADDED_EXCHANGE, "expert_buffer": None, "expert_overflow": "error"}
  return recipes.pod_moe(
      shapes.MAVERICK, global_batch=256, step=dict(attention="flash"), moe=moe,
      mesh=MeshConfig(topology="v5p:4x4x8", ici=(16, 8), axes=("data", "expert"),
                      libtpu_flags=libtpu_flags.ASYNC_ALL_TO_ALL))


# gpt-oss-120b as published (openai/gpt-oss-120b config.json): 36 layers alternating a 128-token
# sliding window and full attention, attention sinks, q/k/v/o biases, YaRN x32 from 4096 positions
# (truncate false), 128 experts top-4 (softmax over the chosen) of 2880 with biases and the clamped
# SwiGLU (limit 7), a biased router; 116.8B params, 5.1B active. Here, not in configs/shapes.py,
# while that file is being edited.
GPT_OSS_120B = TransformerConfig(
    num_layers=36, d_model=2880, num_heads=64, num_kv_heads=8, head_dim=64, d_ff=2880, vocab_size=201088,
    max_len=131072, norm_eps=1e-5, tied_embedding=False, scale_embedding=False, qkv_bias=True, out_bias=True,
    attention_sinks=True, layer_pattern=(LayerKind(window=128), LayerKind()), rope_theta=150000.0,
    rope_scaling=RopeScaling("yarn", factor=32.0, original_max_len=4096, truncate=False),
    moe=MoEConfig(num_experts=128, d_ff=2880, every=1, top_k=4, renormalize=True, router_bias=True,
                  expert_bias=True, swiglu_limit=7.0, dispatch="dropless", aux_loss_weight=3.6,
                  aux_loss_pooling="over_layers"))


# recipes.POD_MOE_RULES with `embed` FSDP-split over `data` alone: d_model 2880 is not a multiple of
# the 128 chips of data x expert.
EMBED_OVER_DATA = tuple(r for r in recipes.POD_MOE_RULES if r != ("embed", ("data", "expert")))


@register("moe.gpt_oss_120b", "gpt-oss-120b as published (36 layers, 128 experts top-4, attention sinks, "
          "sliding window 128 on alternate layers, 116.8B params, 5.1B active); TPU v5p-256 (128 chips: 16 "
          "data x 8 expert), dropless; a dry-run target")
def gpt_oss_120b():
  """GPT_OSS_120B on v5p:4x4x8 at 256 x 4096 tokens a step: the experts split 8 ways over the
  torus' 8-chip ring (16 a chip, FSDP-split over the 16-way `data`: EMBED_OVER_DATA), the tokens
  over both axes.
  Dropless at the no-overflow bound (top-4 of 128 on 8 expert shards: 8 fair shares; expert
  biases refuse a dropping buffer), fixed blocks in 2 async pieces, megablox matmuls, bf16
  weights, Adafactor, remat 'full'. Attention is XLA's einsums: the splash kernel has no sink
  logit (model.attention='auto' picks 'xla' for a model with sinks)."""
  moe = {**recipes.PADDED_EXCHANGE, "expert_buffer": None, "expert_overflow": "error"}
  return recipes.pod_moe(
      GPT_OSS_120B, global_batch=256, step=dict(attention="auto"), moe=moe, rules=EMBED_OVER_DATA,
      mesh=MeshConfig(topology="v5p:4x4x8", ici=(16, 8), axes=("data", "expert"),
                      libtpu_flags=libtpu_flags.ASYNC_ALL_TO_ALL))


@register("lm.gemma3_27b", "Gemma-3-27B (text) as published (62 layers: 5 local of 1024 tokens + 1 global, "
          "27.0B params); TPU v5p-64 (32 chips) FSDP at 2 x 8192 tokens a chip; a dry-run target")
def gemma3_27b():
  """configs/shapes.py GEMMA3_27B on v5p:2x4x4 at 64 x 8192 tokens a step, every weight and the
  batch FSDP-split over the 32 chips; bf16 compute, the splash kernel (sliding window on the
  local layers), remat 'full', the loss in chunks of 1024 positions (no [16384, 262208] f32
  logits a chip at once), Adafactor. The stack scans 10 units of 6 layers; the last 2 local
  layers run after them (the pattern's tail)."""
  model = dataclasses.replace(shapes.GEMMA3_27B, dtype="bfloat16", scan_layers=True, attention="auto",
                              remat="full", loss_chunk=1024)
  return recipes.on_pod(model, seq_len=8192, global_batch=64,
                        mesh=MeshConfig(topology="v5p:2x4x4", ici=(32, 1), axes=("data", "model")),
                        sharding=ShardingConfig(preset="fsdp"))
