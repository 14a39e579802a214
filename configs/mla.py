"""Multi-head latent attention's part of an LM config: `TransformerConfig(..., mla=MLAConfig(...))`.

Composed like `moe`: None = the model's standard (multi-head / grouped-query) attention; set,
every layer attends with MLA (layers/mla.py; DeepSeek-V2/V3, arXiv 2405.04434 section 2.1).
`--set model.mla.kv_lora_rank=512` adds the section to a model without one. The defaults
are DeepSeek-V3's.
"""

from __future__ import annotations

import dataclasses

from shardax.configs.errors import require


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (transformers' names in brackets).

  q_lora_rank:      queries through a low-rank down projection [embed, q_lora_rank], an
                    RMSNorm and an up projection to the heads; None = one plain projection
                    (DeepSeek-V2-Lite) [q_lora_rank].
  kv_lora_rank:     the compressed latent every key and value comes from (after its own
                    RMSNorm); what decoding caches per token, with the RoPE key [kv_lora_rank].
  qk_nope_head_dim: each head's query/key dims without RoPE, keys up-projected from the
                    latent [qk_nope_head_dim].
  qk_rope_head_dim: the decoupled RoPE dims: per head for queries, one key shared by all
                    heads (projected from the input, not the latent) [qk_rope_head_dim].
  v_head_dim:       each head's value dims, apart from the q/k head size [v_head_dim].
  The softmax scale is (qk_nope_head_dim + qk_rope_head_dim)^-1/2, times YaRN's mscale^2
  when a YaRN model.rope_scaling sets mscale_all_dim (configs/rope.py). The RoPE dims rotate
  adjacent pairs, as DeepSeek's checkpoints do, with model.rope_interleave=True."""
  q_lora_rank: int | None = 1536
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128

  def __post_init__(self):
    require(self.q_lora_rank is None or self.q_lora_rank >= 1,
            f"model.mla.q_lora_rank={self.q_lora_rank} must be >= 1, or None for a plain query projection")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
      require(getattr(self, name) >= 1, f"model.mla.{name}={getattr(self, name)} must be >= 1")
    require(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
            f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even and >= 2 (RoPE rotates pairs)")

  @property
  def qk_head_dim(self) -> int:
    """Each head's query/key size: the no-RoPE dims then the RoPE dims."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  def cache_per_token(self) -> int:
    """Cached elements per token and layer: the latent and the shared RoPE key."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  def full_kv_per_token(self, num_heads: int) -> int:
    """What caching every head's key and value would take per token and layer."""
    return num_heads * (self.qk_head_dim + self.v_head_dim)


def check_model(model) -> None:
  """ConfigError naming the field when a TransformerConfig's other fields contradict its `mla`."""
  m = model.mla
  if m is None:
    return
  require(model.num_kv_heads is None or model.num_kv_heads == model.num_heads,
          f"model.num_kv_heads={model.num_kv_heads} with model.mla: every head's key and value come "
          f"from the shared latent (no kv heads to group); set model.num_kv_heads=None")
  require(model.head_dim is None,
          f"model.head_dim={model.head_dim} with model.mla: MLA's head sizes are model.mla."
          f"qk_nope_head_dim + qk_rope_head_dim (q, k) and model.mla.v_head_dim; set model.head_dim=None")
  require(not model.layer_pattern,
          "model.layer_pattern with model.mla: per-layer attention kinds are built for the standard "
          "attention only; use model.attention_window for a uniform window, or model.mla=None")
  require(not model.qk_norm,
          "model.qk_norm=True with model.mla: MLA normalizes its latents (q_lora, kv_lora), not q/k "
          "per head; set model.qk_norm=False")
