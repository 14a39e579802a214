"""Pod experiments of the published model families shardax imports from Hugging Face
(models/hf/), at their published shapes (configs/shapes.py): dry-run targets
(`--mode=dry_run [--shallow]`) on a real TPU topology, on the MoE pod recipe
(experiments/recipes.py pod_moe).
"""

from shardax.configs import register, shapes
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
  fsdp = ("data", "fsdp")
  return recipes.pod_moe(
      shapes.QWEN3_235B, global_batch=256, step=dict(attention="flash", remat="full"),
      moe=dict(dispatch="dropless", grouped_matmul="megablox"), rules=(("batch", fsdp), ("embed", fsdp)),
      mesh=MeshConfig(topology="v5p:4x4x8", ici=(16, 8), axes=fsdp, libtpu_flags=libtpu_flags.ASYNC_COLLECTIVE_FUSION))
