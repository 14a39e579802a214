"""Mixtures (data.mixture): sources drawn by weight through grain's MapDataset.mix, an
exact resume from the per-process data state, and eval per source and in total."""

import json
import math
import os

import numpy as np
import pytest

from shardax import configs
from shardax.configs import ConfigError
from shardax.configs.data import DataConfig
from shardax.trainer.data import inputs, preparation, streaming


def _write(root, letter: str, docs: int, seed: int) -> str:
  """`docs` JSONL documents that all begin with `letter` (its byte id tells the source)."""
  os.makedirs(root, exist_ok=True)
  rng = np.random.default_rng(seed)
  words = [f"{letter.lower()}{i:02d}" for i in range(50)]
  with open(os.path.join(root, "part.jsonl"), "w") as out:
    for i in range(docs):
      out.write(json.dumps({"text": f"{letter}{i} " + " ".join(rng.choice(words, 12))}) + "\n")
  return f"files:{root}/*.jsonl"


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
  d = tmp_path_factory.mktemp("mixture")
  a, b = _write(str(d / "a"), "A", 120, 0), _write(str(d / "b"), "B", 80, 1)
  return DataConfig(mixture=((a, 0.7), (b, 0.3)), data_dir=str(d / "data"), seq_len=32,
                    num_shards=2, validation_fraction=0.25)


def test_mixture_draws_documents_by_weight(mix):
  """Over 2,000 documents of one reader, each source's share is within 2% of its weight,
  and each source keeps its own prepared set."""
  sets = preparation.prepare_components(mix)
  assert len({p.directory for p in sets}) == 2
  docs = streaming.train_documents(sets, [0.7, 0.3], seed=0, reader=0, readers=1)
  first = np.array([int(docs[i][0]) for i in range(2000)])
  assert set(first) == {ord("A"), ord("B")}
  share_a = float(np.mean(first == ord("A")))
  print(f"\nsource A drawn {share_a:.4f} of 2,000 documents (weight 0.7)")
  assert abs(share_a - 0.7) < 0.02
  # every source's own documents are drawn (the mixture is not one source repeated)
  texts_b = {docs[i].tobytes() for i in range(2000) if docs[i][0] == ord("B")}
  assert len(texts_b) > 0.9 * preparation.prepare(mix.for_source(mix.components[1][0])) \
      .split_counts("train")["documents"]


def test_mixture_resumes_exactly_from_the_saved_state(mix):
  """State saved mid-way (through JSON, as a checkpoint holds it), restored into a fresh
  iterator: the rest of the batches are identical, wherever the save falls (some saves
  fall right after a window that ended a document: grain's packer state must survive
  JSON there too)."""
  def take(it, n):
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]
  it = inputs.Batches(mix, "train", 4, process_index=0, process_count=1)
  for _ in range(14):
    state = json.loads(json.dumps(it.get_state()))
    rest = take(it, 3)
    fresh = inputs.Batches(mix, "train", 4, process_index=0, process_count=1)
    fresh.set_state(state)
    again = take(fresh, 3)
    fresh.close()
    for x, y in zip(rest, again):
      for k in x:
        np.testing.assert_array_equal(x[k], y[k])
  it.close()
  tokens = np.concatenate([b["inputs"].ravel() for b in rest])
  assert (tokens == ord("A")).any() and (tokens == ord("B")).any()   # both sources in the batches
  other = DataConfig(**{**mix.__dict__, "mixture": ((mix.mixture[0][0], 0.5), (mix.mixture[1][0], 0.5))})
  with pytest.raises(ValueError, match="mixture"):
    inputs.Batches(other, "train", 4, process_index=0, process_count=1).set_state(state)


@pytest.mark.parametrize("mixture, source, tokenizer, match", [
    ((("stdlib", 1.0),), "stdlib", "byte", "two or more"),
    ((("stdlib", 1.0), ("synthetic", 1.0)), "stdlib", "byte", "text sources only"),
    ((("stdlib", 1.0), ("files:/x/*.txt", -1)), "stdlib", "byte", "positive finite"),
    ((("stdlib", 1.0), ("stdlib", 2.0)), "stdlib", "byte", "twice"),
    ((("stdlib", 1.0), "files:/x/*.txt"), "stdlib", "byte", "not a .source, weight. pair"),
    ((("stdlib", 1.0), ("files:/x/*.txt", 1.0)), "files:/y/*.txt", "byte", "both set"),
    ((("stdlib", 1.0), ("files:/x/*.txt", 1.0)), "stdlib", "spm:train:500", "one shared tokenizer"),
    ((), "mixture", "byte", "needs data.mixture"),
])
def test_mixture_config_errors_name_the_field_and_the_fix(mixture, source, tokenizer, match):
  with pytest.raises(ConfigError, match=match):
    DataConfig(source=source, mixture=mixture, tokenizer=tokenizer)


def test_mixture_from_the_command_line_is_evaluated_per_source_weighted_by_tokens(mix):
  """`--set data.mixture=...` builds; the loop's eval reports each source's loss and bits
  per byte (over its whole validation split) and totals weighted by tokens."""
  import jax
  from shardax.sharding import make_mesh, use_rules
  from shardax.trainer import loop, state as state_lib
  (a, _), (b, _) = mix.mixture
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.d_ff=64",
      "model.max_len=32", "data.seq_len=32", "train.global_batch=8", "mesh.ici=(8, 1)",
      f"data.mixture=(({a!r}, 0.7), ({b!r}, 0.3))", f"data.data_dir={mix.data_dir!r}",
      "data.num_shards=2", "data.validation_fraction=0.25", "train.eval_batches=None"])
  exp = configs.build(cfg)
  assert exp.data.source == "mixture" and exp.data.mixture == mix.mixture
  setup = state_lib.create(exp, make_mesh(exp.mesh))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    state = state_lib.init_fn(setup)(jax.random.key(0))
    e = loop._eval_sources(loop.eval_sums_fn(setup), state["params"], setup)
  nats = text_bytes = 0.0
  assert inputs.source_labels([a, b]) == ["a_jsonl", "b_jsonl"]
  for src, name in zip((a, b), ("a_jsonl", "b_jsonl")):
    counts = preparation.prepare(exp.data.for_source(src)).split_counts("validation")
    assert e[f"eval_weight/{name}"] == counts["tokens"] + counts["documents"]
    np.testing.assert_allclose(e[f"eval_bits_per_byte/{name}"], e[f"eval_loss/{name}"] *
                               e[f"eval_weight/{name}"] / counts["bytes"] / math.log(2), rtol=1e-5)
    nats += e[f"eval_loss/{name}"] * e[f"eval_weight/{name}"]
    text_bytes += counts["bytes"]
  assert e["eval_weight"] == e["eval_weight/a_jsonl"] + e["eval_weight/b_jsonl"]
  np.testing.assert_allclose(e["eval_loss"], nats / e["eval_weight"], rtol=1e-5)
  np.testing.assert_allclose(e["eval_bits_per_byte"], nats / text_bytes / math.log(2), rtol=1e-5)
  line = loop.format_eval(0, 1, exp, e)
  assert "a_jsonl:" in line and "b_jsonl:" in line
