"""The `data.tokenizer` spec: its forms, checked without touching a file or a tokenizer library.

A leaf of the configs (DataConfig validates the spec when built); trainer/data/tokenizers.py
loads the tokenizer a spec names and re-exports these names.
"""

from __future__ import annotations

BYTE_VOCAB = 256
SPM_TRAIN_PREFIX = "spm:train:"
HF_MODEL_PREFIX = "hf_model:"


class TokenizerError(ValueError):
  """A tokenizer spec or file that cannot work; the message says how to fix it."""


def check_spec(spec: str) -> None:
  """A clear error for a malformed data.tokenizer (no files are touched)."""
  if spec == "byte" or spec.startswith(("hf:", HF_MODEL_PREFIX)) or (spec.endswith(".json") and ":" not in spec):
    return
  if spec.startswith(SPM_TRAIN_PREFIX):
    vocab = spec[len(SPM_TRAIN_PREFIX):]
    if not vocab.isdigit() or not 260 <= int(vocab) <= 1_000_000:
      raise TokenizerError(f"data.tokenizer={spec!r}: VOCAB in 'spm:train:VOCAB' must be a "
                           f"number of pieces >= 260 (e.g. 'spm:train:8000')")
    return
  if spec.startswith("spm:") and len(spec) > 4:
    return
  raise TokenizerError(f"data.tokenizer={spec!r}: use 'byte', 'spm:PATH', 'spm:train:VOCAB', "
                       f"'hf:PATH', 'hf_model:PATH' or a tokenizer .json file")


def trained_vocab(spec: str) -> int | None:
  """VOCAB of 'spm:train:VOCAB', else None (known before anything is prepared)."""
  return int(spec[len(SPM_TRAIN_PREFIX):]) if spec.startswith(SPM_TRAIN_PREFIX) else None
