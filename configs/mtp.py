"""Multi-token prediction's part of an LM config: `TransformerConfig(..., mtp=MTPConfig(...))`.

DeepSeek-V3 (arXiv 2412.19437 section 2.2): after the main model, `depth` D sequential modules
each predict one token further ahead. Module k combines the previous depth's representation of
position i with the embedding of token t_{i+k}, runs one transformer block and predicts
t_{i+k+1} through the main model's own output head; the training loss gains
`loss_weight` x mean over k of its cross entropies. The embedding and the output head are the
main model's (shared, not copied). Composed like `moe` and `mla`: None = no MTP; set, the
modules exist in the params, train with the main loss and are never run by decoding or
evaluation. `--set model.mtp.depth=1` adds the section to a model without one.
"""

from __future__ import annotations

import dataclasses
import math

from shardax.configs.errors import require


@dataclasses.dataclass(frozen=True)
class MTPConfig:
  """depth:       D, the modules (Hugging Face DeepSeek-V3's `num_nextn_predict_layers`; 1 there);
                  module k (1-based) predicts the token k + 1 positions after each input's.
  loss_weight:    lambda: loss = main + lambda x mean_k CE_k (DeepSeek-V3: 0.3 for its first
                  10T tokens, 0.1 for the rest)."""
  depth: int = 1
  loss_weight: float = 0.3

  def __post_init__(self):
    require(isinstance(self.depth, int) and self.depth >= 1,
            f"model.mtp.depth={self.depth!r} must be an integer >= 1 (set model.mtp=None for no "
            f"multi-token prediction)")
    require(isinstance(self.loss_weight, (int, float)) and math.isfinite(self.loss_weight)
            and self.loss_weight >= 0,
            f"model.mtp.loss_weight={self.loss_weight!r} must be a finite number >= 0 (DeepSeek-V3: 0.3, "
            f"then 0.1)")


def check_model(model) -> None:
  """ConfigError naming the field when a TransformerConfig's other fields cannot carry its `mtp`."""
  m = model.mtp
  if m is None:
    return
  require(model.pipeline.stages == 1,
          f"model.mtp with model.pipeline.stages={model.pipeline.stages}: the multi-token prediction "
          f"modules run after the last stage on the whole batch, which the pipeline does not lay out; "
          f"set model.pipeline.stages=1 or model.mtp=None")
  require(not model.layer_pattern,
          "model.mtp with model.layer_pattern: an MTP module's block takes the model's uniform attention "
          "fields, and no layer kind says which of the pattern's it would be; set model.mtp=None or "
          "model.layer_pattern=()")
  require(m.depth < model.max_len,
          f"model.mtp.depth={m.depth} must be below model.max_len={model.max_len} (module k predicts "
          f"k + 1 tokens ahead)")
