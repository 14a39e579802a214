"""GShard-style mixture-of-experts LMs: a CPU default and the 1T-parameter pod configuration.

Both use the "expert" sharding preset: experts split over the `data` axis that also
splits the batch (GShard), so the dispatch and combine einsums become all-to-alls.
"""

from shardax.configs import experiment, register
from shardax.configs.moe import MoELMConfig
from shardax.configs.registry import config_tree


def moe_experiment():
  """An experiment tree whose model is a `MoELMConfig` (defaults everywhere else)."""
  cfg = experiment()
  cfg.model = config_tree(MoELMConfig)
  cfg.sharding.preset = "expert"
  return cfg


@register("moe.tiny", "4-layer byte-level LM, 8-expert top-2 MoE FFN every 2nd layer; CPU, minutes")
def tiny():
  cfg = moe_experiment()
  t, m = cfg.model.transformer, cfg.model.moe
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
  """~1.03T parameters (`MoELMConfig.param_count()` = 1,031,538,820,096 at these sizes).

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
  t, m = cfg.model.transformer, cfg.model.moe
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
