"""The experiment schema: small typed dataclasses, composed (never inherited).

An experiment is a `fdl.Config(Experiment, ...)` tree. Command-line `--set a.b=v`
edits that tree; `fdl.build` then creates these dataclasses, and each
`__post_init__` checks its own fields so a mistake is reported by field name,
with the fix, before anything is compiled. Checks that need two sections at
once (e.g. global batch vs. the data-parallel degree) live in `Experiment`.

This module holds the model, optimizer, train, checkpoint and sharding sections and the
`Experiment` that composes them; a section with concepts of its own has its own module:
data (configs/data.py), the model's moe, mla, mtp, pipeline, rope and attention options
(configs/<name>.py) and the mesh (sharding/mesh.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardax.configs import attention as attention_lib
from shardax.configs import flops
from shardax.configs.data import DataConfig
from shardax.configs.errors import ConfigError  # noqa: F401  (re-exported: configs/__init__.py)
from shardax.configs.errors import require as _require
from shardax.configs import mla as mla_lib
from shardax.configs import rope as rope_lib
from shardax.configs.mla import MLAConfig
from shardax.configs import mtp as mtp_lib
from shardax.configs.mtp import MTPConfig
from shardax.configs.moe import MoEConfig
from shardax.configs.pipeline import PipelineConfig, remat_refusal
from shardax.configs.tokenizer_spec import BYTE_VOCAB, trained_vocab
from shardax.sharding.mesh import MeshConfig


# model.remat: recompute policies, and offload policies that move the saved tensors to host
# memory (layers/transformer.py REMAT_POLICIES). model.attention: layers/attention.py.
REMAT_CHOICES = ("none", "full", "dots", "dots_no_batch", "offload", "offload_proj", "offload_qkv", "moe_matmuls",
                 "moe_returned")
ATTENTION_CHOICES = attention_lib.IMPLEMENTATIONS
# model.quantization: the projections' dots in 8 bits, forward and backward (layers/quantization.py).
QUANTIZATION_CHOICES = ("none", "int8", "fp8", "fp8_delayed")
# model.norm (layers/norm.py): RMSNorm, RMSNorm scaled by (1 + w) (Gemma), LayerNorm.
NORMS = ("rms", "rms_plus_one", "layer")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """A decoder-only Transformer language model."""
  vocab_size: int = 256
  num_layers: int = 4
  d_model: int = 256
  num_heads: int = 4
  num_kv_heads: int | None = None     # None = num_heads (multi-head); fewer = grouped-query
  head_dim: int | None = None         # None = d_model // num_heads
  d_ff: int = 1024
  max_len: int = 256
  norm: str = "rms"                   # "rms" | "rms_plus_one" (scale 1 + w: Gemma) | "layer"
  tied_embedding: bool = True
  rope_theta: float = 10_000.0
  activation: str = "silu"            # gate activation of the gated MLP
  dtype: str = "float32"              # compute dtype: "float32" | "bfloat16"
  param_dtype: str = "float32"
  scan_layers: bool = True
  remat: str = "none"                 # one of REMAT_CHOICES (layers/blocks.py says what each keeps)
  attention: str = "xla"              # "xla" (einsum) | "fused" (jax.nn.dot_product_attention) | "flash" | "auto"
  z_loss: float = 0.0                 # weight of mean(logsumexp(logits)^2) in the loss (PaLM: 1e-4); 0 = off
  # Logits and loss in chunks of this many positions of the sequence, each chunk's logits
  # recomputed in the backward pass: no [tokens, vocab] f32 array lives at once. 0 = all at once.
  loss_chunk: int = 0
  mlp: str = "gated"                  # "gated" (act(x W_gate) * x W_up) | "plain" (act(x W_in), T5/GPT)
  parallel_block: bool = False        # x + attn(norm(x)) + mlp(norm(x)) (GPT-J/PaLM) instead of in turn
  # 8-bit training of the q/k/v/out, MLP and expert matmuls (embedding, logits, norms and
  # router stay in `dtype`): "none" | "int8" | "fp8" | "fp8_delayed" (layers/quantization.py).
  quantization: str = "none"
  pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
  # Long context (layers/flash.py, layers/attention.py AttentionOptions).
  attention_window: int | None = None   # sliding-window attention: keys within this many tokens; None = all
  attention_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2: 50); None = off
  # gpt-oss: a learned logit per query head in every softmax's denominator (param attn/sinks);
  # attention 'xla' ('auto' picks it), the decode cache and context parallelism; no kernel takes one.
  attention_sinks: bool = False
  flash_block_q: int = 512            # splash kernel tile sizes (TPU; 'flash' / 'auto')
  flash_block_kv: int = 512
  # Attention when the rules split `length` over a mesh axis (layers/context_parallel.py):
  # "allgather" (all-gather K/V) | "ring" (K/V blocks passed round the axis with ppermute).
  context_parallel: str = "allgather"
  # Options that imported checkpoints need (models/hf/); the defaults are shardax's own model.
  norm_eps: float = 1e-6              # epsilon of every RMSNorm/LayerNorm
  scale_embedding: bool = True        # multiply looked-up rows by sqrt(d_model) (Praxis); HF models: False
  qkv_bias: bool = False              # biases on the q/k/v projections (Qwen2; Llama's attention_bias)
  out_bias: bool = False              # bias on the attention output projection (Llama's attention_bias)
  mlp_bias: bool = False              # biases on the MLP projections (Llama's mlp_bias)
  qk_norm: bool = False               # RMSNorm over the head dim of q and k before RoPE (Qwen3)
  post_norms: bool = False            # also a norm on each branch's output before the residual add (Gemma 2/3)
  query_pre_attn_scalar: float | None = None  # softmax scale = this^-1/2 (Gemma); None = head_dim^-1/2
  final_logit_softcap: float | None = None    # logits -> cap * tanh(logits / cap) (Gemma 2: 30); None = off
  # Llama 4 (transformers' use_qk_norm): q and k of each layer that rotates them divided by their
  # RMS over the head dim (eps norm_eps, no weight), after RoPE; NoPE layers are left alone.
  qk_l2_norm: bool = False
  rope_interleave: bool = False       # RoPE rotates adjacent pairs (0, 1), ... (Llama 4, MLA), not (i, i + d/2)
  # RoPE frequency scaling (configs/rope.py: llama3, yarn or linear); None = plain RoPE.
  rope_scaling: rope_lib.RopeScaling | None = None
  # Mixture of experts (configs/moe.py): None = a dense model; set, the stack's unit is
  # (moe.every - 1) dense layers then one MoE layer, after moe.first_dense_layers dense ones.
  moe: MoEConfig | None = None
  # Multi-head latent attention (configs/mla.py, layers/mla.py): None = multi-head/grouped-query.
  mla: MLAConfig | None = None
  # Multi-token prediction (configs/mtp.py, layers/mtp.py; DeepSeek-V3): None = next-token loss only.
  mtp: MTPConfig | None = None
  # Per-layer attention kinds (configs/attention.py LayerKind: window or chunk, RoPE on/off and
  # its base, temperature tuning): layer i uses kind i % len; () = every layer alike (the fields
  # above). The stack repeats lcm(len, moe.every) layers; layers past the last whole unit are a tail.
  layer_pattern: tuple[attention_lib.LayerKind, ...] = ()
  temperature_floor_scale: float = 8192.0   # LayerKind.temperature_tuning (Llama 4's floor_scale)
  temperature_scale: float = 0.1            # ... and its attn_scale

  def __post_init__(self):
    object.__setattr__(self, "layer_pattern", attention_lib.checked_pattern(self))  # dicts -> kinds
    _require(self.num_layers >= 1, f"model.num_layers={self.num_layers} must be >= 1")
    _require(self.d_model % self.num_heads == 0 or self.head_dim is not None or self.mla is not None,
             f"model.num_heads={self.num_heads} does not divide model.d_model={self.d_model}; "
             f"pick num_heads dividing d_model or set model.head_dim explicitly")
    kv = self.kv_heads
    _require(kv >= 1 and self.num_heads % kv == 0,
             f"model.num_kv_heads={kv} must divide model.num_heads={self.num_heads} "
             f"(grouped-query attention shares each kv head across num_heads/num_kv_heads heads)")
    _require(self.norm in NORMS, f"model.norm={self.norm!r}: use one of {NORMS}")
    self._check_gemma_options()
    _require(self.dtype in ("float32", "bfloat16"), f"model.dtype={self.dtype!r}: use 'float32' or 'bfloat16'")
    _require(self.param_dtype in ("float32", "bfloat16"),
             f"model.param_dtype={self.param_dtype!r}: use 'float32' or 'bfloat16'")
    _require(self.remat in REMAT_CHOICES, f"model.remat={self.remat!r}: use one of {REMAT_CHOICES}")
    _require(self.attention in ATTENTION_CHOICES,
             f"model.attention={self.attention!r}: use one of {ATTENTION_CHOICES}")
    _require(self.attention_window is None or self.attention_window >= 1,
             f"model.attention_window={self.attention_window} must be >= 1 (or None: no window)")
    _require(self.attention_softcap is None or self.attention_softcap > 0,
             f"model.attention_softcap={self.attention_softcap} must be > 0 (or None: off)")
    _require(not self.attention_sinks or (self.attention in ("xla", "auto") and self.mla is None),
             f"model.attention_sinks=True with model.attention={self.attention!r}"
             f"{' and model.mla' if self.mla is not None else ''}: the splash kernel, "
             f"jax.nn.dot_product_attention and multi-head latent attention take no sink logit; use "
             f"model.attention='xla' or 'auto' (which picks 'xla' with sinks) and no mla")
    _require(self.attention_softcap is None or self.attention != "fused",
             "model.attention='fused' (jax.nn.dot_product_attention) has no logit soft-cap; "
             "use model.attention='xla', 'flash' or 'auto', or model.attention_softcap=None")
    for f in ("flash_block_q", "flash_block_kv"):
      _require(getattr(self, f) >= 128 and getattr(self, f) % 128 == 0,
               f"model.{f}={getattr(self, f)} must be a positive multiple of 128 (the TPU lane width)")
    _require(self.quantization in QUANTIZATION_CHOICES,
             f"model.quantization={self.quantization!r}: use one of {QUANTIZATION_CHOICES}")
    _require(self.z_loss >= 0, f"model.z_loss={self.z_loss} must be >= 0 (0 turns it off)")
    _require(self.loss_chunk >= 0, f"model.loss_chunk={self.loss_chunk} must be >= 0 (0: the loss in one piece)")
    _require(self.mlp in ("gated", "plain"), f"model.mlp={self.mlp!r}: use 'gated' or 'plain'")
    _require(self.context_parallel in ("allgather", "ring"),
             f"model.context_parallel={self.context_parallel!r}: use 'allgather' or 'ring'")
    _require(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be > 0")
    rope_lib.check_section(self.rope_scaling)
    mla_lib.check_model(self)
    mtp_lib.check_model(self)
    _require(self.mla is None or not self.qk_l2_norm,
             "model.qk_l2_norm=True with model.mla: multi-head latent attention normalizes its latents, "
             "not the rotated q/k; set model.qk_l2_norm=False")
    m = self.moe
    if m is not None:
      _require(m.first_dense_layers < self.num_layers and
               (self.num_layers - m.first_dense_layers) % m.every == 0,
               f"model.num_layers={self.num_layers} minus model.moe.first_dense_layers="
               f"{m.first_dense_layers} is not a positive multiple of model.moe.every={m.every}; after "
               f"the first dense layers the layers repeat in units of (every - 1) dense + 1 MoE layer")
      _require(m.grouped_matmul != "megablox" or self.quantization == "none",
               f"model.moe.grouped_matmul='megablox' with model.quantization={self.quantization!r}: "
               f"the megablox kernels run the expert matmuls in the compute dtype only; use "
               f"grouped_matmul='ragged_dot' (or 'auto') for 8-bit experts, or quantization='none'")
    p = self.pipeline
    _require(not (self.layer_pattern and p.stages > 1 and self.num_tail_layers),
             f"model.layer_pattern of {len(self.layer_pattern)} kinds with model.pipeline.stages="
             f"{p.stages}: the pipeline stages whole units of {self.layers_per_unit} layers, and "
             f"model.num_layers={self.num_layers} leaves a tail of {self.num_tail_layers}; make "
             f"num_layers a multiple of {self.layers_per_unit} or run without the pipeline")
    refusal = remat_refusal(self.remat, p.stages)
    _require(refusal is None, refusal)
    _require(p.stages == 1 or m is None or m.dispatch == "dropless" or m.second_expert == "all",
             f"model.pipeline.stages={p.stages} with model.moe.dispatch='capacity' and "
             f"second_expert={m.second_expert if m else None!r}: a pipeline stage draws no gating "
             f"keys, so a pipelined MoE model routes deterministically; use "
             f"model.moe.second_expert='all' or dispatch='dropless'")
    if p.stages > 1:
      per = p.stages * p.circular_repeats
      what = (f"model.num_layers={self.num_layers}" if m is None else
              f"the {self.num_units} MoE units (model.num_layers={self.num_layers} after "
              f"{m.first_dense_layers} first dense layers, units of every={m.every})")
      if self.layer_pattern:
        what = (f"the {self.num_stack_units} units of {self.layers_per_unit} layers (model.layer_pattern "
                f"of {len(self.layer_pattern)} kinds, model.num_layers={self.num_layers})")
      _require(self.num_stack_units % per == 0,
               f"{what} is not divisible by pipeline stages x circular_repeats = "
               f"{p.stages} x {p.circular_repeats} = {per}")

  def _check_gemma_options(self) -> None:
    """Gemma's options: positive caps and scalar, and refusals by name where a path lacks them."""
    _require(self.final_logit_softcap is None or self.final_logit_softcap > 0,
             f"model.final_logit_softcap={self.final_logit_softcap} must be > 0 (or None: off)")
    _require(self.query_pre_attn_scalar is None or self.query_pre_attn_scalar > 0,
             f"model.query_pre_attn_scalar={self.query_pre_attn_scalar} must be > 0 (or None: head_dim)")
    _require(not (self.post_norms and self.parallel_block),
             "model.post_norms=True with model.parallel_block=True: a parallel block adds both branches "
             "of one norm; set one of them False")
    if self.mla is not None:
      for field, value, gemma in (("query_pre_attn_scalar", self.query_pre_attn_scalar, True),
                                  ("norm", self.norm, self.norm == "rms_plus_one")):
        _require(value is None or not gemma,
                 f"model.{field}={value!r} with model.mla: multi-head latent attention has its own "
                 f"softmax scale and plain RMSNorm latent norms; unset model.{field} or model.mla")

  @property
  def softmax_scale(self) -> float | None:
    """The attention logits' scale when it is not head_dim^-1/2 (query_pre_attn_scalar^-1/2)."""
    return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

  def attention_options(self, kind: attention_lib.LayerKind | None = None):
    """The attention options these fields describe (with `kind`: that layer kind's mask): a
    configs/attention.py record (the schema does not import layers/; the attention layer
    reads the record's fields)."""
    window = self.attention_window if kind is None else kind.window
    return attention_lib.AttentionOptions(self.attention, window=window, softcap=self.attention_softcap,
                                          chunk=None if kind is None else kind.chunk, sinks=self.attention_sinks,
                                          flash_block_q=self.flash_block_q, flash_block_kv=self.flash_block_kv)

  def layer_kind(self, layer: int) -> attention_lib.LayerKind | None:
    """The kind of 0-based layer `layer` (counted after the first dense layers); None without a
    pattern (every layer as the model's uniform fields say)."""
    return self.layer_pattern[layer % len(self.layer_pattern)] if self.layer_pattern else None

  @property
  def layers_per_unit(self) -> int:
    """Layers in the stack's repeating unit: lcm(len(layer_pattern), moe.every), each 1 when unset."""
    return math.lcm(len(self.layer_pattern) or 1, 1 if self.moe is None else self.moe.every)

  @property
  def num_stack_units(self) -> int:
    """Whole repeating units after the first dense layers (what is scanned and pipelined)."""
    return (self.num_layers - self.num_first_dense) // self.layers_per_unit

  @property
  def num_tail_layers(self) -> int:
    """Layers after the last whole unit (a pattern that does not divide the depth; else 0)."""
    return (self.num_layers - self.num_first_dense) % self.layers_per_unit

  def batch_fields(self, data: DataConfig) -> dict[str, tuple[tuple[int, ...], str, tuple[str, ...]]]:
    """Per-example shape, dtype and logical axes (batch first) of each batch field."""
    tokens = ((data.seq_len,), "int32", ("batch", "length"))
    fields = {"inputs": tokens, "targets": tokens}
    if data.source != "synthetic":  # packed documents: trainer/data/packing.py
      fields.update(segment_ids=tokens, positions=tokens,
                    loss_mask=((data.seq_len,), "float32", ("batch", "length")))
    return fields

  def tokens_per_example(self, data: DataConfig) -> int:
    return data.seq_len

  def flops_per_example(self, data: DataConfig) -> float:
    """Model FLOPs (forward + backward) of one training example; see configs/flops.py."""
    return flops.per_token(self, data.seq_len) * data.seq_len

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  @property
  def num_first_dense(self) -> int:
    """Dense layers before the repeating units (an MoE model's moe.first_dense_layers)."""
    return 0 if self.moe is None else self.moe.first_dense_layers

  @property
  def num_units(self) -> int:
    """Layers that report per-layer statistics: every layer (dense), else the MoE layers
    (with a layer pattern too: one entry per MoE block, not per scanned unit)."""
    if self.moe is None:
      return self.num_layers
    return (self.num_layers - self.moe.first_dense_layers) // self.moe.every

  @property
  def num_moe_layers(self) -> int:
    return 0 if self.moe is None else self.num_units

  def for_decode(self) -> "TransformerConfig":
    """The same model (same params) as decoding runs it: no token copy is ever dropped,
    whatever the training config bets on balance.

    Capacity dispatch: one gating group per sequence of the call (prefill: the padded
    prompt; a generate step: its one token) and capacity = group size
    (`capacity_factor = E/2` reaches the cap S: an expert gets each token at most once),
    so padding and the other rows of the batch cannot change a sequence's output; the
    second expert is always used ('all'), so a token's output does not depend on random
    gating or on how calls group tokens.
    Dropless dispatch: `expert_buffer=None`, the no-overflow bound of the exchange (ragged
    or padded blocks) whatever buffer training used, and `expert_overflow='error'`, so a
    copy that still did not fit poisons the output and is counted, never silently left
    out (decoding raises on the count, naming the layer: trainer/decode.py). A generate
    step carries one token per sequence, so the bound is cheap there; a prefill's receive
    buffers grow with its prompt tokens like a train step's at the bound.
    Both: `dispatch_chunks=1` (the same outputs; a generate step's few tokens per device
    need not divide into pieces). Dense models are returned as they are.
    """
    if self.moe is None:
      return self
    if self.moe.dispatch == "dropless":
      moe = dataclasses.replace(self.moe, expert_buffer=None, expert_overflow="error", dispatch_chunks=1)
    else:
      moe = dataclasses.replace(self.moe, group_size=None, second_expert="all", dispatch_chunks=1,
                                capacity_factor=self.moe.num_experts / 2)
    return dataclasses.replace(self, moe=moe)

  def param_count(self) -> int:
    """Total parameters (all experts), from the config alone: what `gshard_1t` is sized by."""
    return flops.param_count(self)

  @property
  def dim_per_head(self) -> int:
    return self.head_dim or self.d_model // self.num_heads


OPTIMIZERS = ("adamw", "adafactor")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """AdamW or Adafactor with linear warmup and cosine decay, global-norm clipping
  (trainer/optimizer.py; docs/optimizers.md)."""
  name: str = "adamw"                 # "adamw" | "adafactor" (factored second moments)
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  decay_steps: int | None = None      # None = train.steps
  end_learning_rate_fraction: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  clip_norm: float | None = 1.0
  decay_embeddings: bool = True       # weight decay on embedding tables (never on norm scales, biases)
  master_dtype: str | None = None     # e.g. "float32": an fp32 copy of bf16 params; None = param dtype
  # Adafactor only (optax.adafactor); a multiply_by_parameter_scale lr is relative (~1e-2).
  decay_rate: float = 0.8             # second-moment decay: 1 - (step+1)^-decay_rate
  factored_min_dim: int = 128         # factor a weight's moments when two of its dims are >= this
  update_clip: float | None = 1.0     # clip each weight's update to this RMS (None = off)
  parameter_scale: bool = True        # scale steps by each weight's RMS

  def __post_init__(self):
    _require(self.learning_rate > 0, f"optimizer.learning_rate={self.learning_rate} must be > 0")
    _require(self.warmup_steps >= 0, f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")
    _require(self.name in OPTIMIZERS, f"optimizer.name={self.name!r}: use one of {OPTIMIZERS}")
    _require(self.master_dtype in (None, "float32", "bfloat16"),
             f"optimizer.master_dtype={self.master_dtype!r}: use 'float32', 'bfloat16' or None "
             f"(None keeps no copy: the optimizer updates the params in their own dtype)")
    _require(self.update_clip is None or self.update_clip >= 1.0,
             f"optimizer.update_clip={self.update_clip} must be >= 1 (optax's Adafactor) or None")
    _require(0.0 < self.decay_rate <= 1.0, f"optimizer.decay_rate={self.decay_rate} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 1000
  global_batch: int = 32              # sequences per optimizer step, over all devices
  microbatches: int = 1               # gradient accumulation: global_batch split into this many
  eval_every: int = 100
  eval_batches: int | None = None     # None = the whole validation split
  log_every: int = 10
  seed: int = 0
  nonfinite: str = "skip"             # what a non-finite loss/grad does: "skip" the update | "stop"
  profile_steps: tuple[int, ...] = ()  # (first, last) step of a jax profiler trace; () = off
  benchmark_steps: int = 20           # --mode=benchmark: timed steps ...
  benchmark_warmup: int = 2           # ... after this many untimed ones
  target_eval_loss: float | None = None  # --mode=benchmark: train until eval loss <= this (time to train)
  compilation_cache_dir: str | None = None  # None: user cache dir; 'job_dir'; '': off (trainer/compile_cache.py)

  def __post_init__(self):
    _require(self.steps >= 1, f"train.steps={self.steps} must be >= 1")
    _require(self.global_batch >= 1, f"train.global_batch={self.global_batch} must be >= 1")
    _require(self.microbatches >= 1 and self.global_batch % self.microbatches == 0,
             f"train.microbatches={self.microbatches} must divide train.global_batch={self.global_batch}")
    _require(self.eval_batches is None or self.eval_batches >= 1,
             f"train.eval_batches={self.eval_batches} must be >= 1 (or None: the whole validation split)")
    _require(self.nonfinite in ("skip", "stop"), f"train.nonfinite={self.nonfinite!r}: use 'skip' or 'stop'")
    _require(isinstance(self.profile_steps, (tuple, list)) and len(self.profile_steps) in (0, 2)
             and all(s >= 1 for s in self.profile_steps)
             and tuple(self.profile_steps) == tuple(sorted(self.profile_steps)),
             f"train.profile_steps={self.profile_steps}: use (first, last) steps >= 1, or () for off")
    _require(self.benchmark_steps >= 1, f"train.benchmark_steps={self.benchmark_steps} must be >= 1")
    _require(self.benchmark_warmup >= 0, f"train.benchmark_warmup={self.benchmark_warmup} must be >= 0")
    _require(self.target_eval_loss is None or self.target_eval_loss > 0,
             f"train.target_eval_loss={self.target_eval_loss} must be > 0 (or None: no time-to-train run)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = 200                    # save every N steps (and at the end, and on SIGTERM)
  keep: int = 3                       # keep the last N ...
  keep_every: int | None = None       # ... plus every K-th step forever
  async_save: bool = True
  enabled: bool = True
  local_dir: str = ""                 # per-host local tier (SSD, /dev/shm); '' = off (trainer/local_tier.py)
  local_every: int = 0                # ... written every N steps (needs local_dir)
  local_keep: int = 2                 # ... keeping each process's newest N local steps

  def __post_init__(self):
    _require(self.local_keep >= 1, f"checkpoint.local_keep={self.local_keep} must be >= 1 (the newest "
             f"local steps each process keeps; the local tier is turned off with checkpoint.local_dir='')")
    _require(not self.local_dir or self.local_every >= 1,
             f"checkpoint.local_every={self.local_every} must be >= 1 with checkpoint.local_dir="
             f"{self.local_dir!r} (or set checkpoint.local_dir='' to turn the local tier off)")


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  """How logical axis names map to mesh axes.

  preset: a name from `shardax.sharding.rules.PRESETS` ("dp", "fsdp", "tp", "2d", ...);
  rules:  an explicit ordered list of (logical name, mesh axis | tuple of axes | None),
          which, when given, replaces the preset.
  """
  preset: str = "dp"
  rules: tuple[tuple[str, Any], ...] | None = None
  allow_uneven: bool = False          # let the compiler pad dims a mesh axis does not divide


@dataclasses.dataclass(frozen=True)
class Experiment:
  name: str = ""
  description: str = ""
  model: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

  def __post_init__(self):
    # Checks between sections; they apply to language models (configs with these fields).
    if hasattr(self.model, "max_len"):
      _require(self.data.seq_len <= self.model.max_len,
               f"data.seq_len={self.data.seq_len} exceeds model.max_len={self.model.max_len}; "
               f"raise model.max_len or lower data.seq_len")
    if hasattr(self.model, "vocab_size") and (self.data.source in ("stdlib",) or
                                             self.data.source.startswith(("tfds:", "files:"))):
      need = BYTE_VOCAB if self.data.tokenizer == "byte" else trained_vocab(self.data.tokenizer)
      _require(need is None or self.model.vocab_size >= need,
               f"model.vocab_size={self.model.vocab_size} is below the {need} ids of data.tokenizer="
               f"{self.data.tokenizer!r}; set --set model.vocab_size={need}")
