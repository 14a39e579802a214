"""Dense Transformer language models, from a CPU default up to benchmark sizes.

Each is a named shape (configs/shapes.py) with its step settings replaced, plus the run's
sections as values (experiments/recipes.py).
"""

import dataclasses

from shardax.configs import register, shapes
from shardax.configs.registry import config_of
from shardax.configs.data import DataConfig
from shardax.configs.schema import CheckpointConfig, OptimizerConfig, TrainConfig
from shardax.experiments import recipes


@register("lm.tiny", "4-layer byte-level LM on the Python stdlib corpus; trains on a laptop CPU in minutes")
def tiny():
  return recipes.tiny_run(shapes.LM_TINY)


@register("lm.small", "12-layer, 768-wide byte-level LM (~85M params) for benchmarks")
def small():
  return recipes.experiment_of(model=shapes.LM_SMALL, data=DataConfig(seq_len=512),
                               train=TrainConfig(steps=2000, global_batch=16),
                               optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=200),
                               checkpoint=CheckpointConfig(every=500))


@register("lm.1b", "24-layer, 2048-wide LM (~1.2B params), bf16, cuDNN attention: the one-GPU benchmark size")
def one_b():
  """GPT-3 XL's shape with a gated MLP (configs/shapes.py LM_1B); byte-level vocabulary, so
  the embedding is 0.5M of the 1.23B parameters.

  The step settings are the fastest measured on one H100 (docs/performance.md; the variants
  in docs/results/h100.md): remat 'dots', unrolled layers and a batch of 16 x 2048. The
  compiled step fits the 75% of an 80 GB GPU that jax reserves by default; lower
  train.global_batch on a smaller one."""
  cfg = small()
  cfg.model = config_of(dataclasses.replace(shapes.LM_1B, dtype="bfloat16", attention="fused",
                                            remat="dots", scan_layers=False))
  cfg.data.seq_len = 2048
  cfg.optimizer.learning_rate = 3e-4
  return cfg


# The subword twins: the same models reading a SentencePiece vocabulary trained on the
# stdlib's training split at preparation time (stored beside the prepared data). Compare
# them with the byte-level ones by eval bits per byte, not loss per token.

def _subword(cfg, vocab: int):
  """`cfg` reading a SentencePiece vocabulary of `vocab` pieces trained on its corpus."""
  cfg.data.tokenizer = f"spm:train:{vocab}"
  cfg.model.vocab_size = vocab
  return cfg


@register("lm.tiny_spm", "lm.tiny with a 4096-piece SentencePiece vocabulary trained on the stdlib corpus")
def tiny_spm():
  return _subword(tiny(), 4096)


@register("lm.small_spm", "lm.small with an 8192-piece SentencePiece vocabulary trained on the stdlib corpus")
def small_spm():
  return _subword(small(), 8192)
