"""Bounded decode caches on the Hugging Face fixtures (tests/hf_helpers.py): Gemma 3's and
gpt-oss's sliding layers (window 6) and Llama 4's chunked ones (8 tokens) decode on rings, and
teacher-forced on transformers' greedy continuations (3 prompts of 15, 24, 32 tokens + 48 new,
far past 2x the window and the chunk), every step's argmax is transformers' next token and its
logits are the full-length cache's within float32 rounding (`assert_within_rounding`;
tests/test_decode_window.py says why not bit for bit)."""

import jax
import numpy as np
import pytest
from flax import nnx

from shardax import models
from shardax.sharding import use_rules
from shardax.trainer import decode_cache
from hf_helpers import imported, reference
from test_decode_window import assert_within_rounding, is_leaf, ring_and_full


@pytest.mark.parametrize("arch,span", [("gemma3", 6), ("gpt_oss", 6), ("llama4", 8)])
def test_ring_decode_steps_equal_the_full_cache_and_transformers_greedy(arch, span):
  setup, params = imported(arch)
  cfg = decode_cache.decode_config(setup.exp.model)
  graphdef = nnx.split(nnx.eval_shape(lambda: models.build(cfg, nnx.Rngs(0))), nnx.Param, ...)[0]
  model = nnx.merge(graphdef, params)
  ref = reference(arch)
  seqs = [np.concatenate([ref[f"prompt_{j}"], ref[f"greedy_{j}"]]) for j in range(3)]
  lengths = np.asarray([ref[f"prompt_{j}"].size for j in range(3)], np.int32)
  new = ref["greedy_0"].size
  tokens = np.zeros((3, int(lengths.max()) + new), np.int32)
  for j, s in enumerate(seqs):
    tokens[j, :s.size] = s
  slots = {c.shape[-3] for c in jax.tree.leaves(model.cache_spec(3, tokens.shape[1]), is_leaf=is_leaf)
           if c.axes[-1] == "kv"}
  assert slots == {span, tokens.shape[1]}, slots    # rings on the local layers, full on the rest
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, setup.exp.sharding.allow_uneven):
    ring, full = ring_and_full(lambda t, p, c: model.cached(t, p, c)[:2],
                               lambda bounded: model.cache_spec(3, tokens.shape[1], bounded), tokens, lengths)
  greedy = np.stack([ref[f"greedy_{j}"] for j in range(3)], axis=1)      # [new, rows]
  np.testing.assert_array_equal(ring[:new].argmax(-1), greedy)
  assert_within_rounding(ring, full)
