"""How attention is computed, as a plain record the config hands to the attention layer.

`TransformerConfig.attention_options()` returns one. It lives in configs/ because the
schema must not import layers/ (configs sit below layers: layers read configs, never the
reverse). layers/attention.py uses this class (and re-exports it).
"""

from __future__ import annotations

import dataclasses


IMPLEMENTATIONS = ("xla", "fused", "flash", "auto")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """How attention is computed (static; hashable, so a jit cache key). `implementation`:
    'xla'    einsums (layers/attention.py `xla_attention`);
    'fused'  jax.nn.dot_product_attention (cuDNN flash attention on a GPU);
    'flash'  the Pallas splash kernel (layers/flash.py; TPU, or interpret mode elsewhere);
    'auto'   per target platform: 'flash' on a TPU when the lengths suit the kernel,
             'fused' on a GPU, else 'xla'.
  window: sliding-window attention (query i sees keys i - window < j <= i); None = all.
  softcap: logits -> softcap * tanh(logits / softcap); None = off.
  flash_block_q / flash_block_kv: the kernel's tile sizes; interpret: run Pallas in
  interpret mode (tests on a CPU)."""
  implementation: str = "xla"
  window: int | None = None
  softcap: float | None = None
  flash_block_q: int = 512
  flash_block_kv: int = 512
  interpret: bool = False

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise ValueError(f"attention={self.implementation!r}: use one of {IMPLEMENTATIONS}")
