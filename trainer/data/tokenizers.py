"""Tokenizers: text <-> token ids, chosen by `data.tokenizer`.

    byte              utf-8 bytes, ids 1..255; id 0 (NUL, dropped from text) is both the
                      end-of-document id and padding. Vocabulary 256.
    spm:PATH          a SentencePiece model file.
    spm:train:VOCAB   a SentencePiece model with VOCAB pieces, trained on the training
                      split when the data is prepared and stored beside it
                      (`<prepared dir>/tokenizer.model`), so later runs are offline.
    hf:PATH | *.json  a Hugging Face `tokenizers` JSON file (tokenizer.json).
    hf_model:PATH     a Hugging Face model's own tokenizer.json, encoding as the model saw text:
                      with its post-processor's special tokens (e.g. Llama's BOS) and no
                      separator of shardax's own; a document ends with its eos (`own_start`).

Every tokenizer has the same small interface (`Tokenizer`): `encode(str) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, `eos_id` (ends, and in packed windows also starts, each
document) and `pad_id`. `preparation.load_tokenizer(data_cfg)` returns the one a config names (for
spm:train it finds, or makes, the prepared data that holds the trained model): it lives above this
module, which knows nothing of prepared data.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import numpy as np

from shardax.configs.tokenizer_spec import (BYTE_VOCAB, HF_MODEL_PREFIX, SPM_TRAIN_PREFIX,  # noqa: F401
                                            TokenizerError, check_spec, trained_vocab)

SEPARATOR_ID = 0  # the byte tokenizer's end-of-document / padding id
# Special pieces of a trained SentencePiece model: padding, unknown, end of document.
SPM_PAD, SPM_UNK, SPM_EOS = 0, 1, 2
_HF_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_HF_PAD = ("<pad>", "[PAD]", "<|padding|>")
HF_MODEL_FILE = "hf_model.tokenizer.json"   # its copy beside prepared data (from_file tells it apart)


class Tokenizer:
  """text <-> ids. Subclasses set name, vocab_size, eos_id, pad_id and the two methods.
  own_start: encode() begins a document itself (a model's BOS), so no eos goes before it."""
  own_start = False
  name: str
  vocab_size: int
  eos_id: int
  pad_id: int

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def decode(self, ids: Iterable[int]) -> str:
    raise NotImplementedError

  def encode_array(self, text: str, dtype=np.int32) -> np.ndarray:
    """`encode` as a numpy array (preparation's fast path)."""
    return np.asarray(self.encode(text), dtype)

  def _valid(self, ids: Iterable[int]) -> list[int]:
    """ids without padding/end-of-document and without ids a padded model vocab adds."""
    arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
    keep = (arr >= 0) & (arr < self.vocab_size) & (arr != self.eos_id) & (arr != self.pad_id)
    return [int(i) for i in arr[keep]]

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.name}, vocab={self.vocab_size})"


class ByteTokenizer(Tokenizer):
  """utf-8 bytes; NUL is dropped from text so id 0 stays unambiguous."""
  name, vocab_size, eos_id, pad_id = "byte", BYTE_VOCAB, SEPARATOR_ID, SEPARATOR_ID

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8").replace(b"\0", b""))

  def encode_array(self, text: str, dtype=np.int32) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8").replace(b"\0", b""), np.uint8).astype(dtype)

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(self._valid(ids)).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file; its own eos (and pad, else eos) ids."""

  def __init__(self, path: str):
    import sentencepiece as spm
    if not os.path.exists(path):
      raise TokenizerError(f"SentencePiece model {path!r} does not exist; give an existing "
                           f"*.model file (data.tokenizer='spm:PATH') or train one with "
                           f"data.tokenizer='spm:train:VOCAB'")
    self.path = path
    self._sp = spm.SentencePieceProcessor(model_file=path)
    self.name, self.vocab_size = f"spm:{path}", int(self._sp.get_piece_size())
    self.eos_id = int(self._sp.eos_id())
    if self.eos_id < 0:
      raise TokenizerError(f"SentencePiece model {path!r} has no end-of-sentence piece; "
                           f"documents need one (train with eos_id >= 0)")
    self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else self.eos_id

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode(self._valid(ids))


class HuggingFaceTokenizer(Tokenizer):
  """A `tokenizers` JSON file; eos/pad found among the usual special token names.
  `model=True` (spec 'hf_model:PATH') encodes with the post-processor's special tokens."""

  def __init__(self, path: str, model: bool = False):
    import tokenizers
    if not os.path.exists(path):
      raise TokenizerError(f"tokenizer file {path!r} does not exist; give a Hugging Face "
                           f"tokenizer.json (data.tokenizer='hf:PATH')")
    self.path = path
    self.own_start = model   # encode() already starts a document (BOS); see packing.document_example
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.name, self.vocab_size = f"hf:{path}", int(self._tok.get_vocab_size(with_added_tokens=True))
    eos = [self._tok.token_to_id(t) for t in _HF_EOS if self._tok.token_to_id(t) is not None]
    if not eos:
      raise TokenizerError(f"tokenizer {path!r} has none of the end-of-document tokens "
                           f"{_HF_EOS}; add one as a special token")
    pad = [self._tok.token_to_id(t) for t in _HF_PAD if self._tok.token_to_id(t) is not None]
    self.eos_id, self.pad_id = int(eos[0]), int(pad[0]) if pad else int(eos[0])

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=self.own_start).ids

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode(self._valid(ids), skip_special_tokens=True)


def from_spec(spec: str, prepared_dir: str | None = None) -> Tokenizer:
  """The tokenizer `spec` names; spm:train reads `prepared_dir/tokenizer.model`."""
  check_spec(spec)
  if spec == "byte":
    return ByteTokenizer()
  if spec.startswith(SPM_TRAIN_PREFIX):
    if prepared_dir is None:
      raise TokenizerError(f"data.tokenizer={spec!r} is trained at preparation; load it with "
                           f"preparation.load_tokenizer(data_cfg), which prepares the data first")
    return SentencePieceTokenizer(os.path.join(prepared_dir, "tokenizer.model"))
  if spec.startswith("spm:"):
    return SentencePieceTokenizer(os.path.expanduser(spec[4:]))
  if spec.startswith(HF_MODEL_PREFIX):
    return HuggingFaceTokenizer(os.path.expanduser(spec[len(HF_MODEL_PREFIX):]), model=True)
  return HuggingFaceTokenizer(os.path.expanduser(spec[3:] if spec.startswith("hf:") else spec))


def from_file(name: str | None, directory: str) -> Tokenizer:
  """The tokenizer stored in a prepared directory: None = bytes, *.model, *.json."""
  if name is None:
    return ByteTokenizer()
  path = os.path.join(directory, name)
  if name.endswith(".model"):
    return SentencePieceTokenizer(path)
  return HuggingFaceTokenizer(path, model=name == HF_MODEL_FILE)


def check_vocab(tokenizer: Tokenizer, model_vocab: int, spec: str) -> None:
  """The model's embedding must hold every id the tokenizer emits."""
  if model_vocab < tokenizer.vocab_size:
    raise TokenizerError(
        f"model.vocab_size={model_vocab} is smaller than the vocabulary of data.tokenizer="
        f"{spec!r} ({tokenizer.vocab_size} ids); set --set model.vocab_size="
        f"{tokenizer.vocab_size}")


def _spm_sentences(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
  """Training text for SentencePiece: chunks of whole lines up to ~2 KB (its sentence
  limit is 4192 bytes; longer ones are skipped), at most `max_bytes` in all."""
  total = 0
  for text in texts:
    chunk: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
      if size + len(line) > 2048 and chunk:
        yield "".join(chunk)
        chunk, size = [], 0
      chunk.append(line[:2048])
      size += len(chunk[-1])
    if chunk:
      yield "".join(chunk)
    total += len(text)
    if total >= max_bytes:
      return


def train_sentencepiece(texts: Iterable[str], vocab_size: int, model_prefix: str,
                        max_bytes: int = 50_000_000) -> str:
  """Trains a lossless SentencePiece model (identity normalization, byte fallback, no
  dummy prefix: decode(encode(s)) == s) on up to `max_bytes` of `texts`; returns its path.

  The ids are fixed: 0 padding, 1 unknown, 2 end of document (no BOS: the end-of-document
  id starts packed documents too). Newlines are kept as their own piece, so code and
  prose keep their layout.
  """
  import sentencepiece as spm
  spm.SentencePieceTrainer.train(
      sentence_iterator=_spm_sentences(texts, max_bytes), model_prefix=model_prefix,
      vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
      byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=False,
      remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
      user_defined_symbols=["\n"], max_sentence_length=4192, input_sentence_size=2_000_000,
      hard_vocab_limit=False, shuffle_input_sentence=False, pad_id=SPM_PAD, unk_id=SPM_UNK, eos_id=SPM_EOS, bos_id=-1,
      num_threads=max(1, min(4, os.cpu_count() or 1)), minloglevel=2)
  return model_prefix + ".model"
