"""Chunked MoE dispatch (model.moe.dispatch_chunks): the same losses and gradients as one
piece, on 8 simulated devices with the experts split 8 ways, and n times the all-to-alls
at 1/n of the bytes (the pieces really travel apart, so the exchange of one can run under
the expert matmuls of another)."""

import jax
import numpy as np
import pytest

from shardax import configs
from shardax.sharding import report
from shardax.trainer import state as state_lib
from meshtools import loss_and_grads, setup_for

BASE = ["model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
        "model.max_len=16", "model.moe.d_ff=64", "data.seq_len=16", "train.global_batch=8",
        "data.source='synthetic'", "sharding.preset='expert'", "mesh.ici=(8,)", "mesh.axes=('data',)"]
# capacity: C = 4 slots (tokens drop); dropless: 16 tokens per device, buffer at the bound.
DISPATCH = {"capacity": ["model.moe.capacity_factor=1.0"],
            "dropless": ["model.moe.dispatch='dropless'", "model.moe.top_k=2"]}


def run(dispatch: str, chunks: int, params=None):
  cfg = configs.get("moe.tiny")
  configs.apply_overrides(cfg, BASE + DISPATCH[dispatch] + [f"model.moe.dispatch_chunks={chunks}"])
  setup = setup_for(configs.build(cfg))
  if params is None:
    params = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  (loss, grads, metrics), compiled = loss_and_grads(
      setup, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  a2a = [c for c in report.collectives(compiled.as_text()) if c.kind == "all-to-all"]
  return params, float(loss), jax.device_get(grads), metrics, a2a


@pytest.mark.slow   # 4 compiles on 8 devices: ~32 s of CPU
@pytest.mark.parametrize("dispatch", list(DISPATCH))
def test_chunked_dispatch_equals_one_piece(dispatch):
  params, loss, grads, metrics, a2a = run(dispatch, 1)
  _, loss2, grads2, metrics2, a2a2 = run(dispatch, 2, params)
  np.testing.assert_allclose(loss2, loss, rtol=1e-5)
  for k in metrics:
    np.testing.assert_allclose(metrics2[k], metrics[k], rtol=1e-5, atol=1e-7, err_msg=k)
  flat, flat2 = jax.tree.leaves_with_path(grads), jax.tree.leaves(grads2)
  for (path, g), g2 in zip(flat, flat2):
    np.testing.assert_allclose(g2, g, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
  big = lambda cs: sorted(c.bytes for c in cs)[-1]
  assert len(a2a2) >= 2 * len([c for c in a2a if c.bytes == big(a2a)])
  assert big(a2a2) * 2 == big(a2a)          # each piece moves half the rows


def test_dispatch_chunks_must_divide_the_capacity():
  with pytest.raises(ValueError, match="dispatch_chunks=3 must divide the capacity C=4"):
    run("capacity", 3)
