"""Dense Transformer language models, from a CPU default up to benchmark sizes."""

from shardax.configs import experiment, register


@register("lm.tiny", "4-layer byte-level LM on the Python stdlib corpus; trains on a laptop CPU in minutes")
def tiny():
  cfg = experiment()
  cfg.model.num_layers = 4
  cfg.model.d_model = 192
  cfg.model.num_heads = 4
  cfg.model.d_ff = 512
  cfg.model.max_len = 128
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
  cfg = experiment()
  cfg.model.num_layers = 12
  cfg.model.d_model = 768
  cfg.model.num_heads = 12
  cfg.model.d_ff = 3072
  cfg.model.max_len = 512
  cfg.data.seq_len = 512
  cfg.train.steps = 2000
  cfg.train.global_batch = 16
  cfg.optimizer.learning_rate = 1e-3
  cfg.optimizer.warmup_steps = 200
  cfg.checkpoint.every = 500
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
