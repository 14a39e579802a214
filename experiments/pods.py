"""Dense LMs sized for TPU pods, checked on paper with `--mode=dry_run`.

Each experiment names its slice in `mesh.topology`, so
`shardax --exp=pod.lm_16b --job_dir=/tmp/d --mode=dry_run` compiles the real train
step for that slice on any CPU machine with libtpu and reports per-chip memory,
communication and a roofline (docs/scale.md has the table). To train for real on
the pod, drop the topology: `--set mesh.topology=None`.

The GSPMD paper's recipe for its dense models, shared by all of them:
  * the shapes POD_LM_* (configs/shapes.py): d_ff = 4 d_model, heads of 128, vocab 32k;
  * 2D sharding (`sharding.preset=2d`): weights [embed on data, mlp/heads on model],
    activations [batch on data, embed on model]; the model axis stays inside a
    few neighbouring chips, the data axis spans the rest;
  * recipes.POD_STEP (bf16, full remat of each scanned layer) and recipes.ADAFACTOR, whose
    factored state is ~3% of the bf16 params where AdamW's is 2x them; docs/optimizers.md
    compares them on pod.lm_1t (`--set optimizer.name=adamw --set optimizer.learning_rate=1e-4`
    gives AdamW back).
"""

import dataclasses

from shardax.configs import register, shapes
from shardax.configs.schema import ShardingConfig
from shardax.experiments import recipes
from shardax.sharding import MeshConfig


def _pod_lm(shape, topology: str, ici: tuple[int, int], global_batch: int, seq_len: int = 2048):
  return recipes.on_pod(dataclasses.replace(shape, **recipes.POD_STEP), seq_len=seq_len,
                        global_batch=global_batch, mesh=MeshConfig(topology=topology, ici=ici),
                        sharding=ShardingConfig(preset="2d"))


@register("pod.lm_16b", "17.1B dense LM (40 x 5120), 2D sharding on TPU v4-128 (v4:4x4x4, 64 chips)")
def lm_16b():
  return _pod_lm(shapes.POD_LM_16B, "v4:4x4x4", ici=(8, 8), global_batch=256)


@register("pod.lm_128b", "126B dense LM (52 x 12288), 2D sharding on TPU v4-1024 (v4:8x8x8, 512 chips)")
def lm_128b():
  return _pod_lm(shapes.POD_LM_128B, "v4:8x8x8", ici=(32, 16), global_batch=512)


@register("pod.lm_512b", "511B dense LM (76 x 20480), 2D sharding on TPU v5p-2048 (v5p:8x8x16, 1024 chips)")
def lm_512b():
  return _pod_lm(shapes.POD_LM_512B, "v5p:8x8x16", ici=(64, 16), global_batch=1024)


@register("pod.lm_1t", "1.0T dense LM (104 x 24576) on 2048 TPUv3 cores (v3:32x32), the GSPMD paper's scale")
def lm_1t():
  """16 GiB per core hold it with Adafactor; docs/results/experiment_notes.md has the budget."""
  return _pod_lm(shapes.POD_LM_1T, "v3:32x32", ici=(128, 16), global_batch=1024, seq_len=1024)
