"""Dense Transformer language models, from a CPU default up to benchmark sizes.

Each starts from a named shape (configs/shapes.py) and sets its step settings with
`dataclasses.replace`; the rest of the experiment (data, train, optimizer) is set field by field.
"""

import dataclasses

from shardax.configs import experiment, register, shapes
from shardax.configs.registry import config_of


@register("lm.tiny", "4-layer byte-level LM on the Python stdlib corpus; trains on a laptop CPU in minutes")
def tiny():
  cfg = experiment(model=config_of(shapes.LM_TINY))
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


@register("lm.small", "12-layer, 768-wide byte-level LM (~85M params) for benchmarks")
def small():
  cfg = experiment(model=config_of(shapes.LM_SMALL))
  cfg.data.seq_len = 512
  cfg.train.steps = 2000
  cfg.train.global_batch = 16
  cfg.optimizer.learning_rate = 1e-3
  cfg.optimizer.warmup_steps = 200
  cfg.checkpoint.every = 500
  return cfg


@register("lm.1b", "24-layer, 2048-wide LM (~1.2B params), bf16, cuDNN attention: the one-GPU benchmark size")
def one_b():
  """GPT-3 XL's shape with a gated MLP (configs/shapes.py LM_1B); byte-level vocabulary, so
  the embedding is 0.5M of the 1.23B parameters.

  The step settings are the fastest measured on one H100 (docs/performance.md, 2026-11-23):
  remat 'dots' beat no remat (the saved elementwise outputs cost more memory traffic than
  recomputing them), unrolled layers beat scanned ones (a scan zero-fills and copies its
  stacked residuals), and a batch of 16 x 2048 amortizes the optimizer's pass over the
  f32 state: 0.52 s a step, 51% MFU. The compiled step takes 47 GiB, inside the 75% of an
  80 GB GPU that jax reserves by default; lower train.global_batch on a smaller one."""
  cfg = small()
  cfg.model = config_of(dataclasses.replace(shapes.LM_1B, dtype="bfloat16", attention="fused",
                                            remat="dots", scan_layers=False))
  cfg.data.seq_len = 2048
  cfg.train.global_batch = 16
  cfg.optimizer.learning_rate = 3e-4
  return cfg


# The subword twins: the same models reading a SentencePiece vocabulary trained on the
# stdlib's training split at preparation time (stored beside the prepared data). Compare
# them with the byte-level ones by eval bits per byte, not loss per token.

@register("lm.tiny_spm", "lm.tiny with a 4096-piece SentencePiece vocabulary trained on the stdlib corpus")
def tiny_spm():
  cfg = tiny()
  cfg.data.tokenizer = "spm:train:4096"
  cfg.model.vocab_size = 4096
  return cfg


@register("lm.small_spm", "lm.small with an 8192-piece SentencePiece vocabulary trained on the stdlib corpus")
def small_spm():
  cfg = small()
  cfg.data.tokenizer = "spm:train:8192"
  cfg.model.vocab_size = 8192
  return cfg
