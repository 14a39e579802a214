"""The overhead benchmark's yardstick is the same program: a hand-written jax step
(benchmarks/handwritten_step.py) and shardax's train step agree on the layout, the
collectives and the losses, on one device and on the 2D and FSDP meshes. And shardax's
non-finite guard costs no copy of the optimizer state."""

import os
import re
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import overhead  # noqa: E402

from shardax.sharding import make_mesh  # noqa: E402
from shardax.trainer.data import inputs  # noqa: E402
from shardax.trainer import state as state_lib  # noqa: E402

TINY = ["model.d_model=64", "model.num_heads=4", "model.d_ff=128", "data.seq_len=16",
        "model.max_len=16", "model.vocab_size=64"]


def _both(mode):
  exp = overhead.build_experiment(mode, "lm.small", TINY)
  n = 1 if mode == "1" else 8
  setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:n]))
  ours, theirs, _, tx = overhead.compile_both(exp, setup, mode)
  return exp, setup, ours, theirs, tx


@pytest.mark.parametrize("mode", ["2d", "fsdp"])
def test_hand_written_step_is_the_same_program_on_a_mesh(mode):
  exp, setup, ours, theirs, tx = _both(mode)
  # Every collective that moves a tensor: same kind, bytes, group size and count.
  hand, mine = overhead.tensor_collectives(theirs), overhead.tensor_collectives(ours)
  assert hand
  # ... except that XLA may fold the guard's few scalars (its gradient norm, read outside
  # the update) into an all-reduce of tensors: the same collectives, a few floats larger.
  only_mine, only_hand = list((mine - hand).elements()), list((hand - mine).elements())
  assert sorted((k, g) for k, _, g in only_mine) == sorted((k, g) for k, _, g in only_hand)
  assert all(k == "all-reduce" for k, _, _ in only_mine)
  assert 0 <= sum(b for _, b, _ in only_mine) - sum(b for _, b, _ in only_hand) <= 64
  kinds = {k for k, _, _ in hand}
  assert "all-gather" in kinds and "all-reduce" in kinds     # weights gathered, grads reduced
  # shardax adds only the guard's few scalar all-reduces (its grad norm outside the update).
  extra = overhead.scalar_collectives(ours) - overhead.scalar_collectives(theirs)
  assert 0 <= extra <= 4
  # Same start, same batches: same losses step for step.
  a, b = overhead.start_states(setup, tx, ours)
  data = inputs.Batches(exp.data, "train", exp.train.global_batch, setup.batch_sharding,
                        seed=0, vocab_size=exp.model.vocab_size)
  ring = [next(data) for _ in range(2)]
  _, _, losses = overhead.run_pairs(ours, theirs, a, b, ring, rounds=0, steps=3)
  np.testing.assert_allclose(losses["shardax"], losses["hand"], rtol=1e-5)
  assert losses["shardax"][-1] < losses["shardax"][0]


def _big_copies(compiled) -> int:
  """Copies of whole arrays (not scalars) in the program's entry computation."""
  entry = compiled.as_text().split("\nENTRY ", 1)[1]
  return len(re.findall(r"= f32\[\d[\d,]*\]\S* copy\(", entry))


def test_nonfinite_guard_copies_no_optimizer_state_on_a_cpu():
  """A select of new vs old state made XLA copy every Adam moment each step (6% of the
  step on one CPU); on a CPU the guard is a branch, which must leave the program as
  copy-free as the hand-written one."""
  _, _, ours, theirs, _ = _both("1")
  assert _big_copies(ours) <= _big_copies(theirs)
