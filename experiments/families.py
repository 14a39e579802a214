"""Pod experiments of the published model families shardax imports from Hugging Face
(models/hf/), at their published shapes (configs/shapes.py): dry-run targets
(`--mode=dry_run [--shallow]`) on a real TPU topology, on the MoE pod recipe
(experiments/recipes.py pod_moe).
"""

from shardax.configs import register, shapes
from shardax.experiments import recipes
from shardax.sharding import MeshConfig, libtpu_flags


@register("moe.qwen3_235b", "Qwen3-235B-A22B as published (94 layers, 128 experts top-8, 22B active); "
          "TPU v5p-256 (128 chips: 16 data x 8 expert), dropless; a dry-run target")
def qwen3_235b():
  """configs/shapes.py QWEN3_235B on v5p:4x4x8 at 256 x 4096 tokens a step: the experts split 8
  ways over the torus' 8-chip ring (16 a chip, their weights FSDP-split over the 16-way `data`),
  the tokens over both axes. Dropless as Qwen3 trains: the receive buffer is the no-overflow
  bound (8 fair shares for top-8 of 128 on 8 expert shards), so no routing drops a copy; fixed
  blocks exchanged in 2 async pieces (recipes.PADDED_EXCHANGE's exchange), megablox matmuls, the
  splash kernel, bf16 weights, Adafactor, remat 'full'."""
  moe = {**recipes.PADDED_EXCHANGE, "expert_buffer": None, "expert_overflow": "error"}
  return recipes.pod_moe(
      shapes.QWEN3_235B, global_batch=256, step=dict(attention="flash"), moe=moe,
      mesh=MeshConfig(topology="v5p:4x4x8", ici=(16, 8), axes=("data", "expert"),
                      libtpu_flags=libtpu_flags.ASYNC_ALL_TO_ALL))
