"""Pipelined LMs (shardax.pipeline): a CPU default, GPT-3 175B on one v4 pod and over 4 v5e
slices, and a Llama-4-Maverick-shaped MoE over 4 v5p slices (8.4M tokens a step, and 1M, where the
pipeline wins) with its unpipelined twins.

The mesh gets a `stage` axis and the preset a ("stage", "stage") rule (`pp_dp`, `pp_tp`,
`pp_2d`); `model.pipeline` sets stages, microbatches and circular repeats. The pod ones are
dry-run targets: docs/pipeline.md and docs/scale.md have their figures, docs/results/pipeline.md
and docs/results/pipelines_at_pod_scale.md the layouts tried.
"""

import dataclasses

from shardax.configs import register, shapes
from shardax.configs.pipeline import PipelineConfig
from shardax.configs.registry import config_of
from shardax.configs.schema import CheckpointConfig, OptimizerConfig, ShardingConfig
from shardax.experiments import lm, recipes
from shardax.sharding import MeshConfig, libtpu_flags
from shardax.sharding.rules import split_over_stages


@register("lm.tiny_pipelined", "lm.tiny as 2 pipeline stages x 4 microbatches over a (stage, data) mesh; CPU")
def tiny_pipelined():
  """lm.tiny (4 layers) split into 2 stages of 2 layers, pipeline x data parallel.

  The default mesh is (stage=2, data=4, model=1) on 8 simulated CPU devices
  (`mesh.num_cpu_devices=8`, applied by the CLI before jax starts). On one real
  accelerator use `--set mesh.ici=1,1,1`: the same program runs its stages in turn.
  """
  cfg = lm.tiny()
  cfg.model.pipeline = config_of(PipelineConfig(stages=2, microbatches=4))
  cfg.mesh = config_of(MeshConfig(axes=("stage", "data", "model"), ici=(2, -1, 1), num_cpu_devices=8))
  cfg.sharding.preset = "pp_dp"
  return cfg


@register("lm.gpt3_175b_pipelined", "GPT-3 175B (96 layers, d_model 12288) over 4 pipeline stages x data x model")
def gpt3_175b_pipelined():
  """configs/shapes.py GPT3_175B (174.6e9 parameters), 4 stages x 4 circular repeats, 12
  microbatches; a dry-run target, built abstractly, not meant to be compiled on a CPU host.

  Mesh (stage=4, data=-1, model=4) on v4:8x8x8 (512 chips: data=32); the `pp_2d` rules split
  every stage's weights over data x model, so each chip holds 1/512. Per stage: 96 / (4 x 4)
  = 6 layers a visit; bubble (4-1)/(12*4+4-1) = 5.9%. The schedule and the model axis are
  `--mode=plan`'s best with a bubble <= 7% (docs/results/pipeline.md). Global batch 1536 x 2048 tokens
  (GPT-3's 3.2M) in one pass, 128 rows per pipeline microbatch (4 per data shard): pp_2d
  gathers each stage's weights over `data` for every microbatch, so the rows per microbatch
  set the matmul work per gathered byte. What makes the whole batch fit: the splash kernel
  (`attention='flash'`), the stage weights' gradients reduce-scattered per visit
  (pipeline/loop.py `weight_axes`) and the loss a chunk at a time (`loss_chunk`). The weight
  gathers are async (`mesh.libtpu_flags`), so they run under the stage body's matmuls.
  """
  model = dataclasses.replace(shapes.GPT3_175B, dtype="bfloat16", remat="full", attention="flash", loss_chunk=256,
                              pipeline=PipelineConfig(stages=4, microbatches=12, circular_repeats=4))
  mesh = MeshConfig(axes=("stage", "data", "model"), ici=(4, -1, 4), topology="v4:8x8x8",
                    libtpu_flags=libtpu_flags.ASYNC_WEIGHT_GATHER)
  cfg = recipes.on_pod(model, seq_len=2048, global_batch=1536, mesh=mesh, sharding=ShardingConfig(preset="pp_2d"),
                       optimizer=OptimizerConfig(learning_rate=6e-5, warmup_steps=375),
                       checkpoint=CheckpointConfig(every=1000))
  cfg.train.eval_every, cfg.train.eval_batches = 50, 8   # lm.tiny's eval cadence, as registered
  return cfg


@register("lm.gpt3_175b_4slices", "GPT-3 175B pipelined over 4 v5e-256 slices (stages over DCN); a dry-run target")
def gpt3_175b_4slices():
  """lm.gpt3_175b_pipelined on 4 slices of v5e:16x16 (1024 chips, 16 GiB each), one
  pipeline stage per slice: only the stage shifts (one microbatch's activations per
  hop) cross the data-center network, at v5e's ~3 GB/s per chip.

  Without a pipeline the weights must still be split over all 1024 chips to fit (fp32
  AdamW: 12 bytes per param, 2.1 TB), so FSDP gathers weights across slices every layer,
  or (data parallel over DCN) every chip holds a quarter of the model's state and
  all-reduces its gradients over DCN; docs/results/pipelines_at_pod_scale.md compares both, and 2D across the
  slices beats this pipeline here (its program is HBM-bound in every slice).
  Mesh (stage=4 over DCN, data=32, model=8 inside each slice), pp_2d, the v4 schedule;
  the weight gradients as the partitioner likes them here (`grads_in_layout=False`) and no
  libtpu flags (v5e's async collectives take another form, untried).
  """
  cfg = gpt3_175b_pipelined()
  cfg.model.pipeline.grads_in_layout = False
  cfg.mesh = config_of(MeshConfig(axes=("stage", "data", "model"), ici=(1, -1, 8), dcn=(4, 1, 1),
                                  topology="v5e:16x16"))
  return cfg


# shapes.MAVERICK without its layer pattern (chunked-RoPE and NoPE kinds): at these 4096-token
# sequences the kinds cost what full attention costs (one 8192-token chunk covers the sequence;
# NoPE skips a rotation), but their 4-layer unit (lcm(4, moe.every 2)) would let 4 stages take
# only 3 circular repeats (bubble 3/51 at 16 microbatches, 3/15 at 4) instead of these
# schedules' 6 repeats of one dense + MoE pair (3/99, 3/27). moe.llama4_maverick keeps the pattern.
UNIFORM_MAVERICK = dataclasses.replace(shapes.MAVERICK, layer_pattern=())


def _maverick(pipeline: PipelineConfig | None, remat: str, topology: str = "v5p:4x4x8",
              global_batch: int = 2048):
  """configs/shapes.py MAVERICK on 4 v5p slices at 4096-token sequences: bf16 weights,
  Adafactor, the splash kernel, the fine-grained pod exchange (recipes.PADDED_EXCHANGE) with
  async all-to-alls. With `pipeline`, one stage per slice (mesh stage over DCN x expert inside
  each slice; the head and loss on 1/4 of the rows in each slice: split_over_stages); without,
  its unpipelined twin (data over DCN x expert inside each slice). The published model with
  every layer full attention with RoPE (`UNIFORM_MAVERICK`)."""
  axes = ("stage", "data", "expert") if pipeline else ("data", "expert")
  rules = (("stage", "stage"),) + recipes.POD_MOE_RULES if pipeline else recipes.POD_MOE_RULES
  mesh = MeshConfig(topology=topology, axes=axes, ici=(1,) * (len(axes) - 1) + (-1,),
                    dcn=(4,) + (1,) * (len(axes) - 1), libtpu_flags=libtpu_flags.ASYNC_ALL_TO_ALL)
  return recipes.pod_moe(UNIFORM_MAVERICK, global_batch=global_batch, moe=recipes.PADDED_EXCHANGE, mesh=mesh,
                         step=dict(attention="flash", remat=remat, pipeline=pipeline or PipelineConfig()),
                         rules=split_over_stages(rules) if pipeline else rules)


@register("moe.maverick_4slices", "Llama-4-Maverick-shaped MoE (400B params, 17B active) pipelined "
          "over 4 v5p-128 slices: one stage per slice, experts inside each; a dry-run target")
def maverick_4slices():
  """A sparse model over DCN: its weights are 23x what a token uses, so any layout that splits
  or replicates them across slices moves (params / chips per slice) bytes per chip over DCN
  every step, while a pipeline moves only activations (tokens x d_model, per stage
  boundary) and keeps each slice's quarter of the weights, and its all-to-alls, at home.
  4 stages (one per slice) x 6 circular repeats (one unit of a dense and an MoE layer per
  visit: no layer loop in the stage body, so the scheduler can run the shifts over DCN
  under its matmuls) x 16 microbatches of 128 rows (one per chip of the slice): bubble
  3/99 = 3%. remat 'moe_matmuls': the backward recomputes no megablox expert matmul
  (layers/blocks.py). Compare `moe.maverick_4slices_data` (docs/scale.md)."""
  return _maverick(PipelineConfig(stages=4, circular_repeats=6, microbatches=16), remat="moe_matmuls")


@register("moe.maverick_4slices_data", "moe.maverick_4slices without the pipeline: data across the "
          "4 slices, experts inside each (the unpipelined layout to beat)")
def maverick_4slices_data():
  """The same model, batch and slices, unpipelined: mesh (data 4 over DCN x expert 128 per
  slice), experts split over each slice's 128 chips and every weight's embed dim over
  (data, expert), so weights are gathered across slices layer by layer (FSDP over DCN)."""
  return _maverick(None, remat="moe_matmuls")


@register("moe.maverick_4slices_1m", "moe.maverick_4slices at 1M tokens a step on 4 v5p:4x4x4 slices "
          "(64 chips each): the pipeline where it is the right answer; a dry-run target")
def maverick_4slices_1m():
  """The Maverick-shaped MoE fine-tuned at 256 x 4096 tokens (1M) a step over 4 slices of 64
  chips: the regime where a pipeline over DCN wins. The unpipelined twin
  (`moe.maverick_4slices_1m_data`) moves its weights over DCN every step (FSDP over the
  slices: each chip gathers its experts' quarter-shards forward and backward and
  reduce-scatters their gradients), whatever the batch, while its compute shrinks with the
  tokens: at 1M tokens it waits on DCN. The pipeline moves only activations and keeps each
  slice's quarter of the weights at home. 4 stages x 6 circular repeats (one dense + MoE unit
  a visit) x 4 microbatches of 64 rows (one row per chip of a slice): bubble 3/27. remat
  'none': inside the pipeline's per-iteration checkpoint the backward reruns each iteration's
  forward once and keeps what it needs. docs/scale.md compares."""
  return _maverick(PipelineConfig(stages=4, circular_repeats=6, microbatches=4), remat="none",
                   topology="v5p:4x4x4", global_batch=256)


@register("moe.maverick_4slices_1m_data", "moe.maverick_4slices_1m without the pipeline: data across "
          "the 4 slices, experts inside each (the unpipelined layout to beat)")
def maverick_4slices_1m_data():
  """moe.maverick_4slices_data at 1M tokens a step on 4 v5p:4x4x4 slices. remat 'dots', the
  leanest that fits (docs/results/pipelines_at_pod_scale.md)."""
  return _maverick(None, remat="dots", topology="v5p:4x4x4", global_batch=256)
