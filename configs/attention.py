"""How attention is computed, as a plain record the config hands to the attention layer.

`TransformerConfig.attention_options()` returns one. It lives in configs/ because the
schema must not import layers/ (configs sit below layers: layers read configs, never the
reverse). layers/attention.py reads it by field (`options.window`, `dataclasses.replace(
options, implementation=...)`), the same fields as its own `AttentionOptions`, which can
become this class re-exported.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Static (hashable, so a jit cache key) attention settings. `implementation`: 'xla',
  'fused', 'flash' or 'auto' (layers/attention.py resolves 'auto' per platform; the schema
  checks model.attention); window: sliding window (query i sees keys i - window < j <= i),
  None = all; softcap: logits -> softcap * tanh(logits / softcap), None = off;
  flash_block_q / flash_block_kv: the flash kernel's tiles; interpret: Pallas interpret
  mode (tests on a CPU)."""
  implementation: str = "xla"
  window: int | None = None
  softcap: float | None = None
  flash_block_q: int = 512
  flash_block_kv: int = 512
  interpret: bool = False
