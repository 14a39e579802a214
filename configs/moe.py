"""Config of a GShard-style mixture-of-experts LM: a dense TransformerConfig plus MoEConfig.

Composed, not inherited: `MoELMConfig(transformer=TransformerConfig(...), moe=MoEConfig(...))`.
Overrides reach either part by path: `--set model.moe.num_experts=16`,
`--set model.transformer.num_layers=8`. The dense config describes every layer's
attention and the dense FFN of the layers that are not MoE; `moe` describes the
expert FFN that replaces the dense one in every `moe.every`-th layer.
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs import flops
from shardax.configs.schema import ConfigError, DataConfig, TransformerConfig, make_model

SECOND_EXPERT_POLICIES = ("all", "random", "sampling")
SCORES = ("softmax", "sigmoid")
DISPATCHES = ("capacity", "dropless")


def _require(cond: bool, msg: str) -> None:
  if not cond:
    raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """GShard top-2 gating and the expert FFN (arXiv 2006.16668, Algorithm 1 / appendix).

  num_experts:      E, experts per MoE layer (weights [E, embed, d_ff], logical 'expert').
  d_ff:             hidden size of each expert's gated FFN.
  every:            layer i (0-based) is an MoE layer when (i + 1) % every == 0;
                    GShard's every-other-layer is every=2.
  group_size:       S, tokens per gating group (tokens are regrouped to [G, S, embed];
                    capacity and the balance statistics are per group). None = seq_len.
  capacity_factor:  expert capacity C = max(min_capacity, ceil(capacity_factor * 2S / E)),
                    capped at S; tokens past C in an expert are dropped (residual only).
  second_expert:    'all' (always dispatch to the second-best expert), 'random' (keep it
                    with probability 2 * its normalized gate, GShard), 'sampling' (draw the
                    second expert from the softmax of the remaining router logits).
  aux_loss_weight:  weight of the load-balancing loss E^2 * mean_e(me * ce).
  z_loss_weight:    weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0 = off.
  seed:             seed of the gating randomness ('random'/'sampling'); each step folds
                    in a hash of its batch, each layer its index.

  Routers and dispatch of current MoEs (Mixtral, DeepSeek-V3, Qwen3-MoE; layers/routers.py,
  layers/moe_dispatch.py):
  top_k:            experts per token (any k in [1, E]); dispatch='capacity' is GShard's
                    top-2 and needs 2.
  score:            'softmax' (over all E) or 'sigmoid' (per expert, DeepSeek-V3) router scores.
  renormalize:      gates = the chosen k scores divided by their sum (Mixtral, DeepSeek-V3),
                    else the raw scores (softmax top-k without renormalizing, Qwen1.5-MoE).
  gate_scale:       the gates times this (DeepSeek-V3's routed_scaling_factor 2.5).
  bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to
                    the scores for choosing experts only (not to the gates), moved each train
                    step by this rate towards uniform load: b_e += rate * sign(mean load - load_e).
                    0 = off. Needs dispatch='dropless'.
  dispatch:         'capacity' (GShard: fixed slots per expert, tokens past them dropped) or
                    'dropless' (tokens sorted by expert, a grouped matmul, nothing dropped).
  num_shared_experts: experts every token goes through beside its routed ones (DeepSeek), as
                    one gated FFN of width num_shared_experts * d_ff.
  first_dense_layers: the first this-many layers keep a dense FFN (DeepSeek-V3: 3); the
                    every-th rule counts from the layer after them.
  expert_buffer:    dropless under expert parallelism: each device's buffer of token copies
                    sent to one expert shard holds expert_buffer x its fair share (k x its
                    tokens / shards); more is an error (raise it), never a silent drop.
                    None (default): the no-overflow bound n x min(k, E/n) / k for the n
                    expert shards of the mesh in force (a device sends one shard at most
                    min(k, E/n) copies of each token), so no routing can overflow: 4 for
                    Mixtral's top-2 of 8 on 8 shards, 32 for DeepSeek-V3's top-8 of 256
                    on 128 (the dry run's memory shows what that costs). A smaller value
                    saves memory and bets on balance (layers/moe_dispatch.py).
  expert_exchange:  how dropless tokens travel under expert parallelism: 'ragged'
                    (jax.lax.ragged_all_to_all: TPU, GPU), 'padded' (all_to_all of fixed
                    blocks: any backend), 'auto' (ragged unless the mesh is on CPU).
  grouped_matmul:   the dropless expert matmul: 'ragged_dot' (jax.lax.ragged_dot; a grouped
                    kernel on TPU/GPU), 'tiled' (batched matmuls over one-expert row tiles;
                    XLA:CPU runs ragged_dot as E dense matmuls), 'auto' (tiled on CPU).
  """
  num_experts: int = 8
  d_ff: int = 512
  every: int = 2
  group_size: int | None = None
  capacity_factor: float = 2.0
  min_capacity: int = 4
  second_expert: str = "random"
  aux_loss_weight: float = 1e-2
  z_loss_weight: float = 0.0
  seed: int = 0
  top_k: int = 2
  score: str = "softmax"
  renormalize: bool = True
  gate_scale: float = 1.0
  bias_update_rate: float = 0.0
  dispatch: str = "capacity"
  num_shared_experts: int = 0
  first_dense_layers: int = 0
  expert_buffer: float | None = None
  expert_exchange: str = "auto"
  grouped_matmul: str = "auto"

  def __post_init__(self):
    _require(self.num_experts >= 2, f"model.moe.num_experts={self.num_experts} must be >= 2 (top-2 gating)")
    _require(self.d_ff >= 1, f"model.moe.d_ff={self.d_ff} must be >= 1")
    _require(self.every >= 1, f"model.moe.every={self.every} must be >= 1 (1 = every layer is MoE)")
    _require(self.group_size is None or self.group_size >= 1,
             f"model.moe.group_size={self.group_size} must be >= 1, or None for one group per sequence")
    _require(self.capacity_factor > 0, f"model.moe.capacity_factor={self.capacity_factor} must be > 0")
    _require(self.min_capacity >= 1, f"model.moe.min_capacity={self.min_capacity} must be >= 1")
    _require(self.second_expert in SECOND_EXPERT_POLICIES,
             f"model.moe.second_expert={self.second_expert!r}: use one of {SECOND_EXPERT_POLICIES}")
    _require(self.aux_loss_weight >= 0 and self.z_loss_weight >= 0,
             "model.moe.aux_loss_weight and model.moe.z_loss_weight must be >= 0")
    _require(1 <= self.top_k <= self.num_experts,
             f"model.moe.top_k={self.top_k} must be in [1, model.moe.num_experts={self.num_experts}]")
    _require(self.score in SCORES, f"model.moe.score={self.score!r}: use one of {SCORES}")
    _require(self.dispatch in DISPATCHES, f"model.moe.dispatch={self.dispatch!r}: use one of {DISPATCHES}")
    _require(self.bias_update_rate >= 0, f"model.moe.bias_update_rate={self.bias_update_rate} must be >= 0")
    _require(self.num_shared_experts >= 0 and self.first_dense_layers >= 0,
             "model.moe.num_shared_experts and model.moe.first_dense_layers must be >= 0")
    _require(self.expert_buffer is None or self.expert_buffer > 0,
             f"model.moe.expert_buffer={self.expert_buffer} must be > 0, or None for the no-overflow bound")
    _require(self.expert_exchange in ("auto", "ragged", "padded"),
             f"model.moe.expert_exchange={self.expert_exchange!r}: use 'auto', 'ragged' or 'padded'")
    _require(self.grouped_matmul in ("auto", "ragged_dot", "tiled"),
             f"model.moe.grouped_matmul={self.grouped_matmul!r}: use 'auto', 'ragged_dot' or 'tiled'")
    if self.dispatch == "capacity":
      gshard = self.top_k == 2 and self.score == "softmax" and self.renormalize and self.gate_scale == 1.0
      _require(gshard and self.bias_update_rate == 0,
               f"model.moe.dispatch='capacity' is GShard's top-2 softmax gating (top_k=2, "
               f"score='softmax', renormalize=True, gate_scale=1, bias_update_rate=0); got top_k="
               f"{self.top_k}, score={self.score!r}, renormalize={self.renormalize}, gate_scale="
               f"{self.gate_scale}, bias_update_rate={self.bias_update_rate}: use "
               f"model.moe.dispatch='dropless' for other routers")

  def capacity(self, group_size: int) -> int:
    """Slots per expert per group: max(min_capacity, ceil(cf * 2S / E)), at most S.

    An expert can receive at most S tokens of a group (each token picks it at most
    once), so slots beyond S would only ever be empty.
    """
    c = max(self.min_capacity, math.ceil(self.capacity_factor * 2 * group_size / self.num_experts))
    return min(c, group_size)


@dataclasses.dataclass(frozen=True)
class MoELMConfig:
  """A decoder-only LM whose every `moe.every`-th layer has an MoE FFN."""
  transformer: TransformerConfig = dataclasses.field(default_factory=TransformerConfig)
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)

  def __post_init__(self):
    t, m = self.transformer, self.moe
    _require(m.first_dense_layers < t.num_layers and (t.num_layers - m.first_dense_layers) % m.every == 0,
             f"model.transformer.num_layers={t.num_layers} minus model.moe.first_dense_layers="
             f"{m.first_dense_layers} is not a positive multiple of model.moe.every={m.every}; after the "
             f"first dense layers the layers repeat in units of (every - 1) dense + 1 MoE layer")
    _require(t.pipeline.stages == 1,
             "model.transformer.pipeline.stages > 1 is not supported for the MoE LM; use 1")

  def for_decode(self) -> "MoELMConfig":
    """The same model (same params) as decoding runs it: no token is ever dropped.

    One gating group per sequence of the call (prefill: the padded prompt; a generate
    step: its one token) and capacity = group size (`capacity_factor = E/2` reaches the
    cap S: an expert gets each token at most once), so padding and the other rows of the
    batch cannot change a sequence's output; the second expert is always used ('all'),
    so a token's output does not depend on random gating or on how calls group tokens.
    """
    if self.moe.dispatch == "dropless":
      return self   # nothing is ever dropped, and no routing is random
    moe = dataclasses.replace(self.moe, group_size=None, second_expert="all",
                              capacity_factor=self.moe.num_experts / 2)
    return dataclasses.replace(self, moe=moe)

  # Fields the trainer and Experiment read from any LM config.
  @property
  def vocab_size(self) -> int:
    return self.transformer.vocab_size

  @property
  def max_len(self) -> int:
    return self.transformer.max_len

  @property
  def num_moe_layers(self) -> int:
    return (self.transformer.num_layers - self.moe.first_dense_layers) // self.moe.every

  def make(self, rngs):
    return make_model(self, rngs)   # layers/moe_lm.MoELM, registered by layers/__init__.py

  def batch_fields(self, data: DataConfig):
    return self.transformer.batch_fields(data)

  def tokens_per_example(self, data: DataConfig) -> int:
    return data.seq_len

  def flops_per_example(self, data: DataConfig) -> float:
    """Model FLOPs of one example, counting only the activated (top-k and shared) experts."""
    return flops.moe_per_token(self, data.seq_len) * data.seq_len

  def param_count(self) -> int:
    """Total parameters (all experts), from the config alone: what `gshard_1t` is sized by."""
    t, m = self.transformer, self.moe
    d, h, kv, dh = t.d_model, t.num_heads, t.kv_heads, t.dim_per_head
    attn = d * h * dh + 2 * d * kv * dh + h * dh * d
    norms = 2 * d * (2 if t.norm == "layer" else 1)
    n_moe = self.num_moe_layers
    dense_ffn = (t.num_layers - n_moe) * 3 * d * t.d_ff
    moe_ffn = n_moe * (d * m.num_experts + (m.num_experts + m.num_shared_experts) * 3 * d * m.d_ff
                       + (m.num_experts if m.bias_update_rate else 0))
    head = 0 if t.tied_embedding else d * t.vocab_size
    final_norm = d * (2 if t.norm == "layer" else 1)
    return t.num_layers * (attn + norms) + dense_ffn + moe_ffn + t.vocab_size * d + head + final_norm
