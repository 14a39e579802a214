"""Pipelined LMs (shardax.pipeline): a CPU default, GPT-3 175B on one v4 pod and over 4 v5e
slices, and a Llama-4-Maverick-shaped MoE over 4 v5p slices (8.4M tokens a step, and 1M, where the
pipeline wins) with its unpipelined twins.

The mesh gets a `stage` axis and the preset a ("stage", "stage") rule (`pp_dp`,
`pp_tp`, `pp_2d`); `model.pipeline` sets stages, microbatches and circular repeats.
"""

from shardax.configs import register
from shardax.experiments import lm
from shardax.experiments.moe import POD_RULES, moe_experiment, padded_exchange, pod_moe
from shardax.sharding import libtpu_flags
from shardax.sharding.rules import split_over_stages


@register("lm.tiny_pipelined", "lm.tiny as 2 pipeline stages x 4 microbatches over a (stage, data) mesh; CPU")
def tiny_pipelined():
  """lm.tiny (4 layers) split into 2 stages of 2 layers, pipeline x data parallel.

  The default mesh is (stage=2, data=4, model=1) on 8 simulated CPU devices
  (`mesh.num_cpu_devices=8`, applied by the CLI before jax starts). On one real
  accelerator use `--set mesh.ici=1,1,1`: the same program runs its stages in turn.
  """
  cfg = lm.tiny()
  cfg.model.pipeline.stages = 2
  cfg.model.pipeline.microbatches = 4
  cfg.mesh.axes = ("stage", "data", "model")
  cfg.mesh.ici = (2, -1, 1)
  cfg.mesh.num_cpu_devices = 8
  cfg.sharding.preset = "pp_dp"
  return cfg


@register("lm.gpt3_175b_pipelined", "GPT-3 175B (96 layers, d_model 12288) over 4 pipeline stages x data x model")
def gpt3_175b_pipelined():
  """GPT-3 175B, 4 stages x 4 circular repeats, 12 microbatches; a dry-run target.

  GPT-3's FFN is 2 matrices of 12288 x 49152; ours is gated (3 matrices), so
  d_ff = 32768 = 2/3 x 49152 gives the same FFN parameters and FLOPs:
  96 x (4 x 12288^2 + 3 x 12288 x 32768) + 50304 x 12288 = 174.6e9 parameters.
  Mesh (stage=4, data=-1, model=4) on v4:8x8x8 (512 chips: data=32); the `pp_2d`
  rules split every stage's weights over data x model, so each chip holds 1/512.
  Per stage: 96 / (4 x 4) = 6 layers per visit; bubble (4-1)/(12*4+4-1) = 5.9%.
  The schedule and the model axis are `--mode=plan`'s best of stages {4, 8} x model
  axis {4, 8} x microbatches {3S, 4S} x repeats {3, 4} with bubble <= 7% (docs/scale.md);
  until 2026-11-26 it was 8 stages x 2 repeats x 24 microbatches at model=8 (12.7% bubble).
  Global batch 1536 x 2048 tokens (GPT-3's 3.2M) in one pass, 128 rows per pipeline
  microbatch (4 per data shard). pp_2d gathers each stage's weights over `data` for every
  microbatch, so the rows per microbatch set the matmul work per gathered byte: 2
  accumulation steps of 768 rows (as registered until 2026-11-26, when the whole batch
  did not fit) gather twice as often, 63.78 s against 44.85 s. What made the whole
  batch fit: the splash kernel (`attention='flash'`: no [2048, 2048] f32 scores), the
  stage weights' gradients reduce-scattered per visit (pipeline/loop.py `weight_axes`:
  4.75 GiB less temp) and the loss a chunk at a time (`loss_chunk`).
  The stage weights' per-iteration gathers over `data` are async (`mesh.libtpu_flags`,
  visible at the default compile effort only).
  Built abstractly and lowered by dry runs; not meant to be compiled on a CPU host.
  """
  cfg = lm.tiny()
  m = cfg.model
  m.num_layers = 96
  m.d_model = 12288
  m.num_heads = 96
  m.d_ff = 32768
  m.vocab_size = 50304
  m.max_len = 2048
  m.norm = "layer"
  m.activation = "gelu"
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat = "full"
  m.attention = "flash"   # the splash kernel on TPU (layers/flash.py)
  # the logits a sequence chunk at a time: ~2 GiB less per chip (24.15 GiB in all, of 30.75)
  m.loss_chunk = 256
  m.pipeline.stages = 4
  m.pipeline.microbatches = 12
  m.pipeline.circular_repeats = 4
  cfg.data.source = "synthetic"
  cfg.data.seq_len = 2048
  cfg.mesh.axes = ("stage", "data", "model")
  cfg.mesh.ici = (4, -1, 4)
  cfg.mesh.topology = "v4:8x8x8"
  cfg.mesh.num_cpu_devices = None
  # pp_2d gathers each stage's weights over `data` in every iteration: async, the gathers
  # run under the stage body's matmuls (sharding/libtpu_flags.py, docs/pipeline.md)
  cfg.mesh.libtpu_flags = libtpu_flags.ASYNC_WEIGHT_GATHER
  cfg.sharding.preset = "pp_2d"
  cfg.train.global_batch = 1536
  cfg.train.microbatches = 1
  cfg.train.steps = 100_000
  cfg.optimizer.learning_rate = 6e-5
  cfg.optimizer.warmup_steps = 375
  cfg.checkpoint.every = 1000
  return cfg


@register("lm.gpt3_175b_4slices", "GPT-3 175B pipelined over 4 v5e-256 slices (stages over DCN); a dry-run target")
def gpt3_175b_4slices():
  """lm.gpt3_175b_pipelined on 4 slices of v5e:16x16 (1024 chips, 16 GiB each), one
  pipeline stage per slice: only the stage shifts (one microbatch's activations per
  hop) cross the data-center network, at v5e's ~3 GB/s per chip.

  Without a pipeline the weights must still be split over all 1024 chips to fit (fp32
  AdamW: 12 bytes per param, 2.1 TB), so FSDP gathers weights across slices every layer,
  forward and backward, or (data parallel over DCN) every chip holds a quarter of the
  model's state and all-reduces its gradients over DCN; docs/scale.md compares both.
  Mesh (stage=4 over DCN, data=32, model=8 inside each slice), pp_2d; 4 stages x 4
  circular repeats (6 layers per visit), 12 microbatches of 128 rows (4 per data shard),
  the whole batch in one pass, the splash kernel and a chunked loss as on v4: bubble 3/51.
  Weight gradients as the partitioner likes them here (`grads_in_layout=False`: 57.2 s
  against 59.2 s with them reduce-scattered per visit) and no libtpu flags (v5e's async
  collectives take another form, untried). 24 microbatches of 32 rows in 2 accumulation
  steps (registered until 2026-11-26) were 100 s at the default compile effort.
  Not the right answer on these slices: 2D across the slices (37.8 s, docs/scale.md) spends
  1.8 s a step on its cross-slice transfers, while the pipelined program is HBM-bound in
  every slice (memory 36 s against 29 s of compute).
  """
  cfg = gpt3_175b_pipelined()
  cfg.model.pipeline.stages = 4
  cfg.model.pipeline.circular_repeats = 4
  cfg.model.pipeline.microbatches = 12
  cfg.model.pipeline.grads_in_layout = False
  cfg.mesh.topology = "v5e:16x16"
  cfg.mesh.dcn = (4, 1, 1)
  cfg.mesh.ici = (1, -1, 8)
  cfg.mesh.libtpu_flags = ()
  return cfg


def _maverick(slices_over: str, topology: str = "v5p:4x4x8", global_batch: int = 2048):
  """Llama 4 Maverick's shapes where shardax has them (Meta's config.json): d_model 5120, 48
  layers alternating dense (d_ff 16384) and MoE (128 routed experts of d_ff 8192, top-1 of
  sigmoid scores, plus 1 shared expert), 40 query heads of 128 with 8 KV heads, vocab 202048:
  400B parameters, 17B active per token. Not its attention (no chunked attention, RoPE in
  every layer) nor its early-fusion vision. Global batch 2048 x 4096 tokens (8.4M) over 4
  v5p-128 slices (512 chips), bf16 weights, Adafactor, the splash kernel; remat
  'moe_matmuls' (the backward recomputes no megablox expert matmul: layers/blocks.py).
  `slices_over`: 'stage' (the pipeline) or 'data' (its unpipelined twin)."""
  cfg = moe_experiment()
  t, m = cfg.model, cfg.model.moe
  t.num_layers = 48
  t.d_model = 5120
  t.num_heads = 40
  t.num_kv_heads = 8
  t.head_dim = 128
  t.d_ff = 16384
  t.vocab_size = 202048
  t.attention = "flash"
  m.num_experts = 128
  m.d_ff = 8192
  m.every = 2
  m.top_k = 1
  m.num_shared_experts = 1
  m.score = "sigmoid"
  m.aux_loss_weight = 1e-3
  m.dispatch = "dropless"
  padded_exchange(m)   # as moe.deepseek_v3: fixed blocks of 2 fair shares, async all-to-alls in 2 pieces
  cfg = pod_moe(cfg, topology, (1, -1), global_batch=global_batch, seq_len=4096)
  t.remat = "moe_matmuls"
  cfg.mesh.libtpu_flags = libtpu_flags.ASYNC_ALL_TO_ALL
  if slices_over == "stage":
    cfg.mesh.axes = ("stage", "data", "expert")
    cfg.mesh.ici = (1, 1, -1)
    cfg.mesh.dcn = (4, 1, 1)
    cfg.sharding.rules = split_over_stages((("stage", "stage"),) + POD_RULES)
  else:
    cfg.mesh.dcn = (4, 1)
  return cfg


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
  3/99 = 3%. The head and loss run on 1/4 of the rows in each slice (split_over_stages).
  Compare `moe.maverick_4slices_data` (docs/scale.md)."""
  cfg = _maverick("stage")
  p = cfg.model.pipeline
  p.stages = 4
  p.circular_repeats = 6
  p.microbatches = 16
  return cfg


@register("moe.maverick_4slices_data", "moe.maverick_4slices without the pipeline: data across the "
          "4 slices, experts inside each (the unpipelined layout to beat)")
def maverick_4slices_data():
  """The same model, batch and slices, unpipelined: mesh (data 4 over DCN x expert 128 per
  slice), experts split over each slice's 128 chips and every weight's embed dim over
  (data, expert), so weights are gathered across slices layer by layer (FSDP over DCN)."""
  return _maverick("data")


@register("moe.maverick_4slices_1m", "moe.maverick_4slices at 1M tokens a step on 4 v5p:4x4x4 slices "
          "(64 chips each): the pipeline where it is the right answer; a dry-run target")
def maverick_4slices_1m():
  """The Maverick-shaped MoE fine-tuned at 256 x 4096 tokens (1M) a step over 4 slices of 64
  chips: the regime where a pipeline over DCN wins. The unpipelined twin
  (`moe.maverick_4slices_1m_data`) moves its weights over DCN every step (FSDP over the
  slices: each chip gathers its experts' quarter-shards forward and backward and
  reduce-scatters their gradients, 26 GB of DCN buffers per chip), whatever the batch, while
  its compute shrinks with the tokens: at 1M tokens it waits on DCN. The pipeline moves only
  activations (3.4 GB per chip a step) and keeps each slice's quarter of the weights at home.
  4 stages x 6 circular repeats (one dense + MoE unit a visit) x 4 microbatches of 64 rows (one
  row per chip of a slice): bubble 3/27. remat 'none': inside the pipeline's per-iteration
  checkpoint the backward reruns each iteration's forward once and keeps what it needs
  (x1.69 against x1.85 with 'moe_matmuls'; 20.5 GiB per chip). docs/scale.md compares."""
  cfg = _maverick("stage", "v5p:4x4x4", 256)
  p = cfg.model.pipeline
  p.stages = 4
  p.circular_repeats = 6
  p.microbatches = 4
  cfg.model.remat = "none"
  return cfg


@register("moe.maverick_4slices_1m_data", "moe.maverick_4slices_1m without the pipeline: data across "
          "the 4 slices, experts inside each (the unpipelined layout to beat)")
def maverick_4slices_1m_data():
  """moe.maverick_4slices_data at 1M tokens a step on 4 v5p:4x4x4 slices. remat 'dots', the
  leanest that fits: 2.88 s against 2.94 s with 'moe_matmuls'; 'none' asks 111.73 GiB of
  temporaries (95.74 usable)."""
  cfg = _maverick("data", "v5p:4x4x4", 256)
  cfg.model.remat = "dots"
  return cfg
