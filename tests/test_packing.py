"""Packed documents: segment ids, per-document positions, loss mask, and attention that
never crosses a document boundary (einsum and fused paths)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from shardax.trainer.data import packing
from test_layers import TINY, lm_state

EOS = 0
SEQ = 16
# Example lengths (ids + 1): 6+10 | 4+8+4 | 5 + padding: three windows, no document split.
DOC_LENGTHS = (5, 9, 3, 7, 3, 4)


def documents(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, TINY.vocab_size, n).astype(np.int32) for n in DOC_LENGTHS]


def test_windows_carry_segments_positions_and_mask():
  docs = documents()
  w = packing.pack_documents(docs, SEQ, EOS)
  assert w["inputs"].shape == (3, SEQ) and set(w) == set(packing.FIELDS)
  np.testing.assert_array_equal(w["segment_ids"][0], [1] * 6 + [2] * 10)
  np.testing.assert_array_equal(w["positions"][1], list(range(4)) + list(range(8)) + list(range(4)))
  np.testing.assert_array_equal(w["loss_mask"][2], [1] * 5 + [0] * 11)
  np.testing.assert_array_equal(w["inputs"][0, :6], np.concatenate([[EOS], docs[0]]))
  np.testing.assert_array_equal(w["targets"][0, :6], np.concatenate([docs[0], [EOS]]))
  # Every document token is a target exactly once, followed by its end-of-document id.
  targets = w["targets"][w["loss_mask"] > 0]
  np.testing.assert_array_equal(targets, np.concatenate([np.append(d, EOS) for d in docs]))


def test_long_documents_continue_in_the_next_window_and_nothing_is_dropped():
  docs = [np.arange(1, 40, dtype=np.int32), np.arange(50, 53, dtype=np.int32)]
  w = packing.pack_documents(docs, SEQ, EOS)
  targets = w["targets"][w["loss_mask"] > 0]
  np.testing.assert_array_equal(targets, np.concatenate([np.append(d, EOS) for d in docs]))
  assert w["positions"].max() < SEQ  # each piece restarts its positions


@pytest.mark.parametrize("attention", ["xla", "fused"])
def test_packed_loss_is_the_token_weighted_mean_of_each_document_alone(attention):
  cfg = dataclasses.replace(TINY, attention=attention)
  graphdef, state = lm_state(cfg)
  loss_fn = jax.jit(lambda s, b: nnx.merge(graphdef, s).loss_and_metrics(b))
  docs = documents()
  packed = {k: jnp.asarray(v) for k, v in packing.pack_documents(docs, SEQ, EOS).items()}
  loss, metrics = loss_fn(state, packed)
  alone, weights = [], []
  for d in docs:
    ex = packing.document_example(d, EOS)
    l, _ = loss_fn(state, {k: jnp.asarray(v)[None] for k, v in ex.items()})
    alone.append(float(l))
    weights.append(len(d) + 1)
  want = np.average(alone, weights=weights)
  assert float(metrics["loss_weight"]) == sum(weights)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  # Without the segment ids (attention across documents) the packed loss is different.
  crossing, _ = loss_fn(state, {k: v for k, v in packed.items() if k != "segment_ids"})
  assert abs(float(crossing) - want) > 1e-3
