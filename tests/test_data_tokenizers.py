"""Tokenizers: byte, SentencePiece (a file, or trained at preparation), Hugging Face JSON;
the vocabulary reaching the model config."""

import json
import os

import numpy as np
import pytest

from shardax.configs import ConfigError, apply_overrides, build, get
from shardax.configs.data import DataConfig
from shardax.trainer.data import inputs, preparation, sources, tokenizers

TEXT = "def f(x):\n    return {'héllo': x}  # ✓ 𝄞\n\n\tpass\n"


def corpus_files(root, n=40):
  """A small JSONL corpus (field 'content'): the first 4 KB of n stdlib modules, split
  over three files."""
  os.makedirs(root, exist_ok=True)
  paths = sources.stdlib_files(sources.stdlib_root())[:n]
  for f in range(3):
    with open(os.path.join(root, f"part{f}.jsonl"), "w") as out:
      for rel in paths[f::3]:
        text = sources.read_source(os.path.join(sources.stdlib_root(), rel))[:4096]
        out.write(json.dumps({"content": text, "path": rel}) + "\n")
  return os.path.join(root, "*.jsonl")


@pytest.fixture(scope="module")
def spm_cfg(tmp_path_factory):
  d = tmp_path_factory.mktemp("spm")
  return DataConfig(source="files:" + corpus_files(str(d / "corpus")), text_key="content",
                    data_dir=str(d / "data"), tokenizer="spm:train:400", num_shards=2, seq_len=32)


def test_byte_roundtrip_and_ids():
  tok = tokenizers.ByteTokenizer()
  ids = tok.encode(TEXT)
  assert tok.vocab_size == 256 and tok.eos_id == tok.pad_id == 0 and 0 not in ids
  assert ids == list(TEXT.encode("utf-8")) and tok.decode(ids) == TEXT
  np.testing.assert_array_equal(tok.encode_array(TEXT), ids)


def test_trained_sentencepiece_is_stored_beside_the_data_and_lossless(spm_cfg):
  prepared = preparation.prepare(spm_cfg)
  assert os.path.exists(os.path.join(prepared.directory, "tokenizer.model"))
  tok = preparation.load_tokenizer(spm_cfg)
  assert isinstance(tok, tokenizers.SentencePieceTokenizer) and tok.vocab_size == 400
  assert (tok.pad_id, tok.eos_id) == (tokenizers.SPM_PAD, tokenizers.SPM_EOS)
  ids = tok.encode(TEXT)
  assert tok.decode(ids) == TEXT  # identity normalization + byte fallback: lossless
  text = "    def __init__(self, name):\n        return self.name\n"
  assert len(tok.encode(text)) < len(text) / 2  # a real subword vocabulary, not bytes
  assert prepared.manifest["vocab_size"] == tok.vocab_size and prepared.manifest["dtype"] == "uint16"
  # Batches carry the subword ids; every target is a valid id.
  batch = next(inputs.Batches(spm_cfg, "train", 4))
  assert int(np.asarray(batch["targets"]).max()) < 400


def test_spm_path_and_hf_json_files(spm_cfg, tmp_path):
  import tokenizers as hf
  model = os.path.join(preparation.prepare(spm_cfg).directory, "tokenizer.model")
  tok = tokenizers.from_spec("spm:" + model)
  assert tok.decode(tok.encode(TEXT)) == TEXT and tok.vocab_size == 400
  # A byte-level BPE tokenizer.json trained here with the `tokenizers` library.
  bpe = hf.Tokenizer(hf.models.BPE())
  bpe.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = hf.decoders.ByteLevel()
  trainer = hf.trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<|endoftext|>"],
                                   initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
  bpe.train_from_iterator([TEXT * 3, "def value index return self"] * 20, trainer)
  path = str(tmp_path / "tokenizer.json")
  bpe.save(path)
  for spec in ("hf:" + path, path):
    tok = tokenizers.from_spec(spec)
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.decode(tok.encode("abc") + [tok.eos_id]) == "abc"
  cfg = DataConfig(source=spm_cfg.source, text_key="content", data_dir=str(tmp_path / "d"),
                   tokenizer="hf:" + path, num_shards=2)
  prepared = preparation.prepare(cfg)
  assert prepared.manifest["tokenizer_file"] == "tokenizer.json"
  assert prepared.tokenizer().decode(prepared.tokenizer().encode(TEXT)) == TEXT


@pytest.mark.parametrize("spec", ["spm:train:abc", "spm:train:10", "wordpiece", "spm:"])
def test_bad_tokenizer_spec_is_a_config_error(spec):
  with pytest.raises(ConfigError, match="data.tokenizer"):
    DataConfig(tokenizer=spec)


def test_missing_tokenizer_file_says_so(tmp_path):
  with pytest.raises(tokenizers.TokenizerError, match="does not exist"):
    tokenizers.from_spec(f"spm:{tmp_path}/none.model")


def test_vocab_size_must_hold_the_tokenizer(spm_cfg):
  cfg = get("lm.tiny")
  apply_overrides(cfg, ["data.tokenizer='spm:train:1000'"])
  with pytest.raises(ConfigError, match=r"model.vocab_size=256 is below the 1000 ids.*"
                                        r"model.vocab_size=1000"):
    build(cfg)
  apply_overrides(cfg, ["model.vocab_size=1000"])
  build(cfg)
  tok = preparation.load_tokenizer(spm_cfg)  # a tokenizer file's size is known once it is loaded
  with pytest.raises(tokenizers.TokenizerError, match=rf"model.vocab_size=256 is smaller.*{tok.vocab_size}"):
    tokenizers.check_vocab(tok, 256, spm_cfg.tokenizer)
  tokenizers.check_vocab(tok, 512, spm_cfg.tokenizer)  # a padded embedding is fine
