"""GShard-style mixture-of-experts LMs: a CPU default and the 1T-parameter pod configuration.

Both use the "expert" sharding preset: experts split over the `data` axis that also
splits the batch (GShard), so the dispatch and combine einsums become all-to-alls.
"""

from shardax.configs import experiment, register
from shardax.configs.moe import MoEConfig
from shardax.configs.registry import config_tree
from shardax.sharding import libtpu_flags


def moe_experiment():
  """An experiment tree whose model has MoE layers (`model.moe`; defaults everywhere else)."""
  cfg = experiment()
  cfg.model.moe = config_tree(MoEConfig)
  cfg.sharding.preset = "expert"
  return cfg


@register("moe.tiny", "4-layer byte-level LM, 8-expert top-2 MoE FFN every 2nd layer; CPU, minutes")
def tiny():
  cfg = moe_experiment()
  t, m = cfg.model, cfg.model.moe
  t.num_layers = 4
  t.d_model = 128
  t.num_heads = 4
  t.d_ff = 512
  t.max_len = 128
  m.num_experts = 8
  m.d_ff = 256
  m.every = 2
  m.capacity_factor = 1.25
  m.second_expert = "random"
  m.aux_loss_weight = 1e-2
  cfg.data.seq_len = 128
  cfg.train.steps = 200
  cfg.train.global_batch = 16
  cfg.train.eval_every = 50
  cfg.train.eval_batches = 8
  cfg.train.log_every = 10
  cfg.optimizer.learning_rate = 3e-3
  cfg.optimizer.warmup_steps = 30
  cfg.checkpoint.every = 100
  return cfg


@register("moe.gshard_1t", "GShard-scale top-2 MoE LM: 2048 experts, 40 layers, ~1.03T params, TPUv3-2048")
def gshard_1t():
  """~1.03T parameters (`TransformerConfig.param_count()` = 1,031,538,820,096 at these sizes).

  20 MoE layers x 2048 experts x 3 x 1024 x 8192 (gated FFN) = 1.0308e12 expert weights,
  plus 0.74e9 for attention, the 20 dense FFNs, routers and the embedding. GShard's own
  1T model used a 2-matrix ReLU FFN and 60 layers; a gated FFN has 3 matrices, so 40
  layers give the same size. One expert per TPUv3 core (v3:32x32 = 2048 cores), groups
  of 2048 tokens (2 sequences) per core, capacity max(4, ceil(2.0 x 2 x 2048 / 2048)) = 4.
  Adafactor, as GShard trained it, each expert's matrix factored on its own: the dry run
  (v3:32x32, --compile_effort=-1, 2026-11-23) gives 7.15 GiB per core, 0.31 GiB of it
  optimizer state (AdamW: 11.49 GiB, 4.66 GiB state; docs/scale.md).
  Built abstractly by dry runs; not meant to be compiled on a CPU host.
  """
  cfg = moe_experiment()
  t, m = cfg.model, cfg.model.moe
  t.num_layers = 40
  t.d_model = 1024
  t.num_heads = 16
  t.d_ff = 8192
  t.vocab_size = 32768
  t.max_len = 1024
  t.dtype = "bfloat16"
  t.param_dtype = "bfloat16"
  t.remat = "full"
  m.num_experts = 2048
  m.d_ff = 8192
  m.every = 2
  m.group_size = 2048
  m.capacity_factor = 2.0
  m.second_expert = "random"
  cfg.data.source = "synthetic"
  cfg.data.seq_len = 1024
  cfg.mesh.ici = (-1, 1)
  cfg.mesh.topology = "v3:32x32"
  cfg.train.global_batch = 4096
  cfg.train.steps = 100_000
  cfg.optimizer.name = "adafactor"  # GShard's optimizer: factored second moments, per expert
  cfg.optimizer.learning_rate = 1e-2  # relative to each weight's RMS (parameter_scale)
  cfg.optimizer.warmup_steps = 10_000
  cfg.checkpoint.every = 1000
  return cfg


def _like_lm_tiny(cfg):
  """lm.tiny's shape, data and schedule (experiments/lm.py), so the bits per byte compare."""
  t = cfg.model
  t.num_layers = 4
  t.d_model = 192
  t.num_heads = 4
  t.d_ff = 512
  t.max_len = 128
  cfg.data.seq_len = 128
  cfg.train.steps = 250
  cfg.train.global_batch = 32
  cfg.train.eval_every = 50
  cfg.train.eval_batches = 8
  cfg.train.log_every = 10
  cfg.optimizer.learning_rate = 3e-3
  cfg.optimizer.warmup_steps = 30
  cfg.checkpoint.every = 100
  return cfg


@register("moe.mixtral_tiny", "lm.tiny with every FFN a Mixtral MoE: top-2 of 8 experts (d_ff 256), "
          "renormalized softmax gates, dropless; lm.tiny's active FLOPs per token; CPU, minutes")
def mixtral_tiny():
  """Each token goes through 2 experts of d_ff 256: lm.tiny's FFN width 512 in active
  FLOPs (plus the 192 x 8 router), with 4x the FFN parameters.

  Learning rate 2e-3, not lm.tiny's 3e-3: at 3e-3 this MoE ties lm.tiny (1000 steps, 64
  validation batches: 2.0480 bits/byte against 2.0367) and at 5e-3 it is far worse; at 2e-3
  it beats lm.tiny at either rate (1.9865 against 2.0367 at 3e-3 and 2.0107 at 2e-3;
  docs/moe.md, "Learning rate")."""
  cfg = _like_lm_tiny(moe_experiment())
  cfg.optimizer.learning_rate = 2e-3
  m = cfg.model.moe
  m.num_experts = 8
  m.d_ff = 256
  m.every = 1
  m.top_k = 2
  m.score = "softmax"
  m.renormalize = True
  m.dispatch = "dropless"
  m.aux_loss_weight = 1e-2
  return cfg


@register("moe.deepseek_tiny", "lm.tiny as a DeepSeek-V3-style MoE: layer 1 dense, then 32 fine-grained "
          "experts (d_ff 64), sigmoid top-7 (gates x2.5) + 1 shared expert, bias balancing; lm.tiny's active FLOPs")
def deepseek_tiny():
  """Active FFN per token: 7 routed + 1 shared expert of d_ff 64 = lm.tiny's 512. Balance:
  DeepSeek-V3's auxiliary-loss-free bias (rate 1e-3 per step) and a tiny balance loss
  (its sequence-wise alpha, 1e-4). Gates renormalized over the 7 and scaled by 2.5, V3's
  routed_scaling_factor: without it each routed expert's output is ~1/7 of the shared
  one's, and as Adam's steps do not grow with that factor the routed experts learn ~7x
  slower in what they add (measured, docs/moe.md: 1000 steps, 2.0283 bits/byte with it on 64
  validation batches, lm.tiny 2.0367, without it 2.0567). Learning rate 2e-3, as
  mixtral_tiny: 1.9874 bits/byte at 1000 steps against lm.tiny's 2.0107 at the same rate
  (docs/moe.md, "Learning rate")."""
  cfg = _like_lm_tiny(moe_experiment())
  cfg.optimizer.learning_rate = 2e-3
  m = cfg.model.moe
  m.num_experts = 32
  m.d_ff = 64
  m.every = 1
  m.first_dense_layers = 1
  m.top_k = 7
  m.num_shared_experts = 1
  m.score = "sigmoid"
  m.renormalize = True
  m.gate_scale = 2.5
  m.bias_update_rate = 1e-3
  m.aux_loss_weight = 1e-4
  m.dispatch = "dropless"
  return cfg


# Pod configurations (dry-run them: `--mode=dry_run --shallow`, docs/moe.md has the table).
# Experts split over their own `expert` mesh axis; the tokens over (data, expert), so the
# dropless exchange is an all-to-all within each expert group; every other weight (and
# each expert's embed dim) FSDP-split over what its other dims leave free.
POD_RULES = (("batch", ("data", "expert")), ("batch", "data"), ("expert", "expert"),
             ("embed", ("data", "expert")), ("embed", "data"))


def pod_moe(cfg, topology: str, ici: tuple[int, int], global_batch: int, seq_len: int):
  """An MoE experiment as a pod dry-run target: bf16, full remat, scanned, synthetic data,
  (data, expert) mesh with POD_RULES, Adafactor (experiments/pipelined.py uses it too)."""
  t = cfg.model
  t.dtype = "bfloat16"
  t.param_dtype = "bfloat16"
  t.remat = "full"
  t.scan_layers = True
  t.tied_embedding = False
  t.max_len = seq_len
  cfg.data.source = "synthetic"
  cfg.data.seq_len = seq_len
  cfg.mesh.topology = topology
  cfg.mesh.ici = ici
  cfg.mesh.axes = ("data", "expert")
  cfg.sharding.preset = None
  cfg.sharding.rules = POD_RULES
  cfg.train.global_batch = global_batch
  cfg.train.steps = 100_000
  cfg.optimizer.name = "adafactor"
  cfg.optimizer.learning_rate = 1e-2
  cfg.optimizer.warmup_steps = 2000
  cfg.checkpoint.every = 1000
  return cfg


@register("moe.mixtral_8x7b", "Mixtral-8x7B-shaped MoE LM (46.7B params, 12.9B active): 32 layers, "
          "top-2 of 8 experts, dropless; TPU v5p-256 (128 chips, FSDP, all experts on every chip)")
def mixtral_8x7b():
  """Mixtral 8x7B's shapes (arXiv 2401.04088): d_model 4096, 32 heads of 128, 8 KV heads,
  every FFN 8 experts of gated d_ff 14336, top-2 renormalized softmax gates; rope theta 1e6."""
  cfg = moe_experiment()
  t, m = cfg.model, cfg.model.moe
  t.num_layers = 32
  t.d_model = 4096
  t.num_heads = 32
  t.num_kv_heads = 8
  t.d_ff = 14336
  t.vocab_size = 32000
  t.rope_theta = 1e6
  m.num_experts = 8
  m.d_ff = 14336
  m.every = 1
  m.top_k = 2
  m.dispatch = "dropless"
  m.aux_loss_weight = 1e-2
  # MaxText's layout for it: no expert parallelism. Every chip runs all 8 experts on its own
  # tokens (no all-to-all, no receive buffer: the grouped matmuls see exactly T x k rows),
  # the expert weights FSDP-split over all 128 chips and gathered per layer like a dense
  # FFN's; megablox's kernels, whose weight gradient visits only filled row tiles (XLA's
  # ragged_dot gradient is a dense matmul over all 8 experts x every row); splash attention.
  m.grouped_matmul = "megablox"
  t.attention = "flash"
  cfg = pod_moe(cfg, "v5p:4x4x8", (16, 8), global_batch=256, seq_len=4096)
  # FSDP over two mesh axes (the 4x4 plane, the 8-chip dim): the dispatch gathers the expert
  # weights one axis at a time, which libtpu writes as all-gathers and reduce-scatters; one
  # 128-chip axis got all-reduces of every whole expert weight (docs/moe.md).
  cfg.mesh.axes = ("data", "fsdp")
  cfg.sharding.rules = (("batch", ("data", "fsdp")), ("embed", ("data", "fsdp")))
  cfg.mesh.libtpu_flags = libtpu_flags.ASYNC_COLLECTIVE_FUSION
  # The HBM left over (temp 11.8 GiB of 95.7 under 'full') holds each layer's expert matmul
  # outputs and attention projections (~2.5 GiB a layer): the backward recomputes neither.
  t.remat = "moe_matmuls"
  return cfg


def padded_exchange(m):
  """The dropless exchange of the fine-grained pod configs (the Maverick ones; moe.deepseek_v3
  starts from it and bounds each device's total instead, with the ragged exchange).

  The no-overflow bound (None) is 32 fair shares on DeepSeek-V3 (128 shards x min(8, 2) / 8):
  the compiler asks 97.31 GiB per chip for it, over v5p's 95.74 usable; the largest that fits
  with >= 1 GiB spare, 29, is priced at 40.3 s per step (MFU 5.9%: the receive buffer's empty
  rows are priced as grouped-matmul work). So these configs bet on balance (bias balancing,
  DeepSeek-V3's own answer): 2 fair shares (42.85 GiB with the ragged exchange; dry runs
  2026-11-26, docs/moe.md), and copies past them are dropped and logged as
  moe/dropped_copies instead of stopping the run. The exchange: async all-to-alls of those
  fixed blocks, in 2 pieces so one piece's exchange runs under the other's megablox matmuls
  (this libtpu never makes ragged-all-to-all async). DeepSeek-V3, --shallow dry run
  2026-11-26: 12.32 s (19.4%) -> 10.58 s (22.5%); exposed all-to-alls remain (docs/moe.md).
  """
  m.expert_buffer = 2.0
  m.expert_overflow = "drop"
  m.expert_exchange = "padded"
  m.dispatch_chunks = 2
  m.grouped_matmul = "megablox"


@register("moe.deepseek_v3", "DeepSeek-V3-shaped MoE LM (675B params): 61 layers (3 dense), "
          "256 fine-grained experts top-8 + 1 shared, sigmoid gates, bias balancing; TPU v5p-2048")
def deepseek_v3():
  """DeepSeek-V3's shapes (arXiv 2412.19437) where shardax has them: d_model 7168, 61 layers
  of which the first 3 dense (d_ff 18432), then 256 routed experts of d_ff 2048, top-8 of
  sigmoid scores renormalized and scaled by 2.5, 1 shared expert, auxiliary-loss-free bias
  (rate 1e-3) and a 1e-4 balance loss; vocab 129280. Not its attention: MLA is not
  implemented, so 128 query heads of 128 with 8 KV heads (GQA) stand in; nor multi-token
  prediction. 1024 chips: 16 data x 64 expert, the experts over the topology's 8 x 8
  plane, four per chip and layer."""
  cfg = moe_experiment()
  t, m = cfg.model, cfg.model.moe
  t.num_layers = 61
  t.d_model = 7168
  t.num_heads = 128
  t.num_kv_heads = 8
  t.head_dim = 128
  t.d_ff = 18432
  t.vocab_size = 129280
  m.num_experts = 256
  m.d_ff = 2048
  m.every = 1
  m.first_dense_layers = 3
  m.top_k = 8
  m.num_shared_experts = 1
  m.score = "sigmoid"
  m.renormalize = True
  m.gate_scale = 2.5
  m.bias_update_rate = 1e-3
  m.aux_loss_weight = 1e-4
  m.dispatch = "dropless"
  padded_exchange(m)
  # The ragged exchange: only the rows that go travel, and each device's receive buffer holds
  # 1.25 fair shares of what its expert group sends it, however the senders split it (copies
  # past it are dropped and logged as moe/dropped_copies). A bet on the batch's balance, which
  # bias balancing steers, measured on a trained router (benchmarks/moe_drops.py,
  # moe.deepseek_tiny, 4 experts a device, groups of 64 half-sequences): 0.00% of the copies
  # dropped once the bias has settled (1000 steps at rate 1e-3, or 250 at 1e-2), as the padded
  # exchange's 2 fair shares per (sequence piece, device) block (0.01%); 1.82% against 0.15%
  # at step 250 while it settles (docs/moe.md). Full compile, 2026-11-26: 6.74 s (35.4%) ->
  # 5.82 s (41.0%), 90.32 -> 74.63 GiB per chip; this libtpu runs ragged-all-to-all
  # synchronously, so all 1.25 s of it is exposed.
  m.expert_exchange = "ragged"
  m.expert_buffer = 1.25
  # The splash kernel: the XLA einsum attention wrote f32 [8, 16, 4096, 4096] scores per
  # layer and computed the whole square. --shallow, 2026-11-26: 10.58 s (22.5%) -> 10.06 s
  # (23.7%), memory 5.32 -> 3.12 s; the step is still the exchange's (docs/moe.md).
  t.attention = "flash"
  # The experts over an 8 x 8 plane of the torus, not the 8 x 16 one of (8, 128): both
  # closed rings, so an all-to-all's bytes travel 8/4 + 8/4 = 4 hops on average over 4 links
  # instead of 8/4 + 16/4 = 6 (perf/links.py), and each chip holds 4 experts (their
  # weights still FSDP-split over `data`, now 16-way). Full compile, default effort,
  # 2026-11-26: 7.237 s (32.9%) -> 6.74 s (35.4%), all-to-all 3.20 -> 2.12 s, 89.92 -> 90.32
  # GiB per chip (docs/moe.md).
  cfg = pod_moe(cfg, "v5p:8x8x16", (16, 64), global_batch=1024, seq_len=4096)
  cfg.mesh.libtpu_flags = libtpu_flags.ASYNC_ALL_TO_ALL
  # Keep the expert gate/up outputs and the returned expert outputs (layers/blocks.py): the
  # backward recomputes the dispatch exchange but no expert matmul and not the return
  # exchange. Full compile, default effort, 2026-11-26: 9.688 s (24.6%) -> 8.326 s (28.6%),
  # recompute x1.95 -> x1.53, all-to-all 5.41 -> 4.51 s, 20.48 -> 90.35 GiB per chip of
  # 95.74 (docs/moe.md).
  cfg.model.remat = "moe_returned"
  # What travels to the experts goes in fp8, as in DeepSeek-V3 (the rows; in the backward the
  # expert outputs' gradient), what comes back in bf16: all-to-all 4.51 -> 3.20 s, 8.326 s
  # (28.6%) -> 7.237 s (32.9%); the rows alone in fp8: 3.64 s, 7.673 s (31.1%).
  cfg.model.moe.fp8_dispatch = True
  return cfg
