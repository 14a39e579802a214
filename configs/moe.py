"""The mixture-of-experts part of an LM config: `TransformerConfig(..., moe=MoEConfig(...))`.

Composed, not inherited, and one model: the TransformerConfig describes every layer's
attention and the dense FFN of the layers that are not MoE; `moe` describes the expert FFN
that replaces the dense one in every `moe.every`-th layer. Overrides reach both by path:
`--set model.moe.num_experts=16`, `--set model.num_layers=8` (an MoE model's own fields
once lived under `model.transformer.`; those paths are refused with the new one).
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs.errors import require as _require

SECOND_EXPERT_POLICIES = ("all", "random", "sampling")
SCORES = ("softmax", "sigmoid")
DISPATCHES = ("capacity", "dropless")


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
                    capped at S; token copies past C in an expert are dropped (no expert
                    output, the residual carries them) and counted (warn_dropped_fraction).
  second_expert:    'all' (always dispatch to the second-best expert), 'random' (keep it
                    with probability 2 * its normalized gate, GShard), 'sampling' (draw the
                    second expert from the softmax of the remaining router logits).
  aux_loss_weight:  weight of the load-balancing loss E^2 * mean_e(me * ce).
  aux_loss_pooling: how several MoE layers' balance losses combine: 'per_layer' (the mean of
                    each layer's loss) or 'over_layers' (transformers' load_balancing_loss_func,
                    Mixtral's and Qwen3-MoE's: me and ce averaged over the MoE layers first, then
                    E * sum_e(me * ce); what a Hugging Face import trains with). Dropless only.
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
  gate_input:       the gate scales the routed expert's input, FFN(gate * x), instead of its
                    output, gate * FFN(x) (Llama 4); top_k=1 (one gate per token) and dropless.
  bias_update_rate: auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to
                    the scores for choosing experts only (not to the gates), moved each train
                    step by this rate towards uniform load: b_e += rate * sign(mean load - load_e).
                    0 = off. Needs dispatch='dropless'.
  n_group, topk_group: group-limited routing (DeepSeek-V3: 8 and 4): the E experts form
                    n_group equal groups of consecutive experts, each token keeps the topk_group
                    groups whose two best (biased) scores sum highest and picks its top_k experts
                    (capacity: its top-2) within them (layers/routers.py `group_limit`).
                    n_group=1: plain top-k over all experts.
  dispatch:         'capacity' (GShard: fixed slots per expert, tokens past them dropped) or
                    'dropless' (tokens sorted by expert, a grouped matmul; nothing dropped
                    unless expert_overflow='drop' with an expert_buffer below the bound).
  num_shared_experts: experts every token goes through beside its routed ones (DeepSeek), as
                    one gated FFN of width num_shared_experts * d_ff.
  first_dense_layers: the first this-many layers keep a dense FFN (DeepSeek-V3: 3); the
                    every-th rule counts from the layer after them.
  expert_buffer:    dropless under expert parallelism: each device's buffer of token copies
                    sent to one expert shard holds expert_buffer x its fair share (k x its
                    tokens / shards); what happens to copies past it is expert_overflow's
                    choice: an error that stops the run, or a drop that is counted.
                    None (default): the no-overflow bound n x min(k, E/n) / k for the n
                    expert shards of the mesh in force (a device sends one shard at most
                    min(k, E/n) copies of each token), so no routing can overflow: 4 for
                    Mixtral's top-2 of 8 on 8 shards, 32 for DeepSeek-V3's top-8 of 256
                    on 128 (the dry run's memory shows what that costs). A smaller value
                    saves memory and bets on balance (layers/moe_dispatch.py).
  expert_overflow:  what a token copy past a smaller expert_buffer does: 'error' (the step is
                    not applied and the loop raises naming expert_buffer) or 'drop' (it gets no
                    expert output, the residual carries it, as capacity dispatch drops; counted:
                    warn_dropped_fraction).
  expert_exchange:  how dropless tokens travel under expert parallelism: 'ragged'
                    (jax.lax.ragged_all_to_all: TPU, GPU), 'padded' (all_to_all of fixed
                    blocks: any backend), 'auto' (ragged unless the mesh is on CPU).
  grouped_matmul:   the dropless expert matmul: 'ragged_dot' (jax.lax.ragged_dot; a grouped
                    kernel on TPU/GPU), 'tiled' (batched matmuls over one-expert row tiles;
                    XLA:CPU runs ragged_dot as E dense matmuls), 'megablox' (megablox's
                    Pallas gmm/tgmm kernels, TPU; the weight gradient visits only filled
                    row tiles), 'auto' (tiled on CPU).
  dispatch_chunks:  split each MoE layer's dispatch into this many independent pieces, each
                    its own all-to-all, expert FFN and all-to-all back, so a scheduler can
                    run the exchange of one piece under the expert matmuls of another
                    (capacity: over the C slots of every expert, which must divide by it;
                    dropless: over each device's tokens, under expert parallelism only:
                    without it nothing is exchanged and the tokens go in one piece). Same
                    outputs as 1 (the default) up to float summation order; a dropless
                    buffer below the bound is per piece.
  fp8_dispatch:     dropless under expert parallelism: what travels to the experts goes in
                    fp8 (e4m3, a power-of-two scale per row and 128 columns), about half the
                    bytes: the token rows, and in the backward the expert outputs' gradient
                    (DeepSeek-V3's dispatch). The expert outputs and the rows' gradient come
                    back in the activations' dtype (its combine). The experts compute on the
                    dequantized rows (layers/moe_dispatch.py `_fp8_sent`).
  router_bias:      a bias on the router logits, learned (gpt-oss's router.bias); False: none.
  expert_bias:      biases in every expert's FFN: on its gate and up outputs [E, d_ff] and its
                    down output [E, embed] (gpt-oss); the down bias is part of the expert's
                    output, so it is weighted by the gate. False: none. Not with
                    expert_overflow='drop' (a dropped copy would still get its down bias).
  swiglu_limit:     gpt-oss's clamped SwiGLU in the experts (layers/glu.py): gate clamped above
                    at this, up to [-limit, limit], hidden = (up + 1) * gate * sigmoid(
                    swiglu_alpha * gate); None: act(gate) * up with model.activation. Not with
                    shared experts (a dense gated MLP).
  swiglu_alpha:     the sigmoid's gain of that SwiGLU (gpt-oss: 1.702).
  warn_dropped_fraction: the share of token copies dropped (capacity, or expert_overflow=
                    'drop') over one logging window above which training warns, once per
                    run, naming the worst layers and the field that changes it. Every window's
                    fraction goes to metrics.jsonl / TensorBoard as moe/dropped_copies (each
                    layer's as moe/dropped_copies/layer_<i> when any dropped, an MTP depth's
                    block as moe/dropped_copies/mtp_<k>), on the progress line whenever it is
                    not 0, and eval reports its own (eval_moe/dropped_copies).
  """
  num_experts: int = 8
  d_ff: int = 512
  every: int = 2
  group_size: int | None = None
  capacity_factor: float = 2.0
  min_capacity: int = 4
  second_expert: str = "random"
  aux_loss_weight: float = 1e-2
  aux_loss_pooling: str = "per_layer"
  z_loss_weight: float = 0.0
  seed: int = 0
  top_k: int = 2
  score: str = "softmax"
  renormalize: bool = True
  gate_scale: float = 1.0
  gate_input: bool = False
  bias_update_rate: float = 0.0
  n_group: int = 1
  topk_group: int = 1
  dispatch: str = "capacity"
  num_shared_experts: int = 0
  first_dense_layers: int = 0
  expert_buffer: float | None = None
  expert_overflow: str = "error"
  expert_exchange: str = "auto"
  grouped_matmul: str = "auto"
  dispatch_chunks: int = 1
  fp8_dispatch: bool = False
  router_bias: bool = False
  expert_bias: bool = False
  swiglu_limit: float | None = None
  swiglu_alpha: float = 1.702
  warn_dropped_fraction: float = 0.01

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
    _require(self.aux_loss_pooling in ("per_layer", "over_layers"),
             f"model.moe.aux_loss_pooling={self.aux_loss_pooling!r}: use 'per_layer' or 'over_layers'")
    _require(self.aux_loss_pooling == "per_layer" or self.dispatch == "dropless",
             f"model.moe.aux_loss_pooling='over_layers' is computed by the dropless router; use "
             f"dispatch='dropless' or aux_loss_pooling='per_layer'")
    _require(1 <= self.top_k <= self.num_experts,
             f"model.moe.top_k={self.top_k} must be in [1, model.moe.num_experts={self.num_experts}]")
    _require(not self.gate_input or (self.top_k == 1 and self.dispatch == "dropless"),
             f"model.moe.gate_input=True (the gate scales the expert's input, Llama 4) is implemented for "
             f"top_k=1 with dispatch='dropless'; got top_k={self.top_k}, dispatch={self.dispatch!r}")
    _require(self.score in SCORES, f"model.moe.score={self.score!r}: use one of {SCORES}")
    _require(self.n_group >= 1 and self.num_experts % self.n_group == 0,
             f"model.moe.n_group={self.n_group} must be >= 1 and divide model.moe.num_experts={self.num_experts}")
    _require(1 <= self.topk_group <= self.n_group,
             f"model.moe.topk_group={self.topk_group} must be in [1, model.moe.n_group={self.n_group}]")
    per_group = self.num_experts // max(self.n_group, 1)
    _require(self.n_group == 1 or per_group >= 2,
             f"model.moe.n_group={self.n_group} leaves {per_group} expert per group; a group scores "
             f"the sum of its two best experts: use n_group <= {self.num_experts // 2}")
    _require(self.top_k <= self.topk_group * per_group,
             f"model.moe.top_k={self.top_k} is more than the {self.topk_group * per_group} experts of "
             f"topk_group={self.topk_group} groups of {per_group}: raise model.moe.topk_group or lower top_k")
    _require(self.dispatch in DISPATCHES, f"model.moe.dispatch={self.dispatch!r}: use one of {DISPATCHES}")
    _require(self.bias_update_rate >= 0, f"model.moe.bias_update_rate={self.bias_update_rate} must be >= 0")
    _require(self.num_shared_experts >= 0 and self.first_dense_layers >= 0,
             "model.moe.num_shared_experts and model.moe.first_dense_layers must be >= 0")
    _require(self.expert_buffer is None or self.expert_buffer > 0,
             f"model.moe.expert_buffer={self.expert_buffer} must be > 0, or None for the no-overflow bound")
    _require(self.expert_overflow in ("error", "drop"),
             f"model.moe.expert_overflow={self.expert_overflow!r}: use 'error' or 'drop'")
    _require(self.expert_overflow == "error" or self.dispatch == "dropless",
             f"model.moe.expert_overflow='drop' is the dropless dispatch's buffer policy; "
             f"model.moe.dispatch={self.dispatch!r} drops by capacity_factor: leave it 'error'")
    _require(self.expert_exchange in ("auto", "ragged", "padded"),
             f"model.moe.expert_exchange={self.expert_exchange!r}: use 'auto', 'ragged' or 'padded'")
    _require(self.grouped_matmul in ("auto", "ragged_dot", "tiled", "megablox"),
             f"model.moe.grouped_matmul={self.grouped_matmul!r}: use 'auto', 'ragged_dot', 'tiled' "
             f"or 'megablox'")
    _require(0 <= self.warn_dropped_fraction <= 1,
             f"model.moe.warn_dropped_fraction={self.warn_dropped_fraction} must be in [0, 1] (a "
             f"share of the token copies routed; 0.01 = warn above 1%)")
    _require(self.dispatch_chunks >= 1, f"model.moe.dispatch_chunks={self.dispatch_chunks} must be >= 1")
    _require(not self.fp8_dispatch or self.dispatch == "dropless",
             f"model.moe.fp8_dispatch=True is for model.moe.dispatch='dropless' (got {self.dispatch!r}): "
             f"set dispatch='dropless', or fp8_dispatch=False")
    _require(not (self.expert_bias and self.expert_overflow == "drop"),
             "model.moe.expert_bias=True with model.moe.expert_overflow='drop': a copy dropped past the "
             "buffer would still get its expert's down bias; use expert_overflow='error'")
    _require(self.swiglu_limit is None or self.swiglu_limit > 0,
             f"model.moe.swiglu_limit={self.swiglu_limit} must be > 0 (or None: no clamped SwiGLU)")
    _require(self.swiglu_limit is None or self.num_shared_experts == 0,
             f"model.moe.swiglu_limit={self.swiglu_limit} with num_shared_experts={self.num_shared_experts}: "
             f"the shared experts are a dense gated MLP without the clamp; use one or the other")
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
