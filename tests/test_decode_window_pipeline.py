"""Decoding a pipelined stack whose layer pattern has a windowed layer: the stages' caches hold
rings of window slots for the local layers (the scanned ring-cache path, layers/blocks.py
`scan_cached` over the stage-layout weights), and greedy decoding makes the tokens the same
weights make unpipelined on one device."""

import jax
import numpy as np
import pytest

from shardax import pipeline
from shardax.trainer import decode
from test_decode import NEW, SMALL, assert_greedy_matches_full_forward, experiment, generator, params_of, prompts
from test_decode_window import WINDOW

PATTERN = [f"model.layer_pattern=({{'window': {WINDOW}}}, {{}})"]   # a local then a global layer


def unstaged(params, repeats: int):
  """The pipelined model's params in the unpipelined stack's layout ([units, ...])."""
  flat = jax.tree.map(np.asarray, params)
  flat["layers"]["blocks"] = jax.tree.map(lambda a: np.asarray(pipeline.from_stages(a, repeats)),
                                          flat["layers"]["blocks"])
  return flat


@pytest.mark.parametrize("layers,repeats", [(4, 1), (8, 2)], ids=["2_stages", "2_stages_circular_2"])
def test_pipelined_windowed_pattern_decodes_the_unpipelined_tokens(layers, repeats):
  """2 stages (x 2 circular repeats) on the (stage 2, data 4) mesh: prompts of 1..17 tokens
  (most longer than the window of 4) and 12 new ones each; the ids equal the unpipelined
  model's on one device with the same weights, and the pipelined cache's local layers hold
  rings of 4 slots (the global ones every position). Both are the full forward's argmax, so a
  fault the two layouts share (the ring itself) shows too."""
  sets = [*SMALL, *PATTERN, f"model.num_layers={layers}", "model.pipeline.stages=2",
          "model.pipeline.microbatches=4", f"model.pipeline.circular_repeats={repeats}"]
  piped = experiment(*sets, name="lm.tiny_pipelined")
  plain = experiment(*SMALL, *PATTERN, f"model.num_layers={layers}", "mesh.ici=(1, 1)")
  assert piped.model.pipeline.stages == 2 and dict(zip(piped.mesh.axes, piped.mesh.ici))["stage"] == 2
  params, batch, greedy = params_of(piped), prompts(), decode.Sampling(max_new_tokens=NEW)
  staged = generator(piped, params)
  ids = staged.run(batch, greedy).ids
  flat = unstaged(params, repeats)
  want = generator(plain, flat, jax.devices()[:1]).run(batch, greedy).ids
  np.testing.assert_array_equal(ids, want)
  assert_greedy_matches_full_forward(plain, flat, batch, want)   # and both are the model's tokens
  assert len({tuple(row) for row in np.asarray(want)}) > 4   # context-dependent tokens, not one repeated
  tokens, lengths = staged.padded(batch, NEW)
  cache, _ = staged.prefill(tokens, lengths, NEW)
  slots = sorted({a.shape[-3] for a in jax.tree.leaves(cache) if a.ndim >= 5})
  assert slots == [WINDOW, int(tokens.shape[1])], slots
