"""Where a step's memory goes and what takes it back: the compiled program's buffer list
(perf/buffers.py), the chunked loss (model.loss_chunk) and the dry run's lever hint."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from shardax import configs, models


def _build(*sets):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, list(sets))
  return configs.build(cfg)


def _value_and_grad(model_cfg, batch):
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(models.build(model_cfg, nnx.Rngs(0)))
  loss = lambda s: nnx.merge(graphdef, s).loss_and_metrics(batch)[0]
  return jax.jit(jax.value_and_grad(loss))(state)


def test_chunked_loss_gives_the_unchunked_loss_and_gradients():
  """model.loss_chunk computes the logits 8 positions at a time (recomputed in the backward
  pass); the loss (cross entropy + z-loss) and every gradient equal the one-piece loss's."""
  exp = _build("model.num_layers=1", "data.seq_len=32", "model.max_len=32", "model.z_loss=1e-2")
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, exp.model.vocab_size)
  batch = {"inputs": tokens, "targets": jax.numpy.roll(tokens, -1, axis=1)}
  batch["loss_mask"] = (jax.numpy.arange(32) < 27).astype(np.float32)[None].repeat(2, 0)
  whole = _value_and_grad(exp.model, batch)
  chunked = _value_and_grad(dataclasses.replace(exp.model, loss_chunk=8), batch)
  np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), chunked[1], whole[1])


def test_loss_chunk_that_does_not_divide_the_sequence_is_refused():
  exp = _build("model.num_layers=1", "data.seq_len=32", "model.max_len=32", "model.loss_chunk=12")
  tokens = np.zeros((1, 32), np.int32)
  with pytest.raises(ValueError, match="model.loss_chunk=12 does not divide"):
    _value_and_grad(exp.model, {"inputs": tokens, "targets": tokens})


# A small LM step compiled for a TPU topology: its logits are 2 x 256 x 65536 f32 per chip
# (128 MiB: too big for the on-chip VMEM the compiler uses for small temporaries).
TPU = ["data.source='synthetic'", "model.num_layers=1", "data.seq_len=256", "model.max_len=256",
       "train.global_batch=8", "sharding.preset='fsdp'", "model.vocab_size=65536",
       "mesh.topology='v5e:2x2'", "mesh.ici=(4,1)"]


@pytest.fixture(scope="module")
def tpu_step():
  """(experiment, per-device memory, buffer list) of the small LM step compiled for v5e:2x2."""
  pytest.importorskip("libtpu")
  from shardax.perf import dry_run
  from shardax.sharding import report
  exp = _build(*TPU)
  _, setup = dry_run.prepare(exp)
  compiled, buffers = dry_run.compile_with_buffers(setup, top=24)
  mem = {"params": dry_run._shard_bytes(setup.abstract["params"]),
         "optimizer_state": dry_run._shard_bytes(setup.abstract["opt_state"]),
         "temp": report.memory(compiled)["temp_bytes"]}
  return exp, mem, buffers


def test_buffer_list_names_the_logits_with_their_compiled_size(tpu_step):
  """The largest device buffer of the step is the logits, read from the compiled program:
  shape [batch per chip, length, vocab] float32, bytes = 2 x 256 x 65536 x 4, made by the
  head's dot (op_name) in the embedding's attend (lm.tiny ties the head to the embedding)."""
  _, _, buffers = tpu_step
  logits = [b for b in buffers if b.space == "device" and b.shape == (2, 256, 65536)]
  assert logits, [(b.shape, b.source) for b in buffers]
  b = logits[0]
  assert b.dtype == "f32" and b.bytes == 2 * 256 * 65536 * 4
  assert "dot_general" in b.op_name and "embedding.py" in b.source and "attend" in b.source
  assert buffers[0] == b   # nothing else in this step is as large


def test_hint_ranks_the_chunked_loss_first_when_logits_dominate(tpu_step):
  """The dry run's hint ranks the unused levers by the bytes they free: on this step the
  logits (and their gradient) dominate, so model.loss_chunk comes first, and a config that
  already chunks its loss is not offered it again."""
  from shardax.perf import levers
  exp, mem, buffers = tpu_step
  listed = [dataclasses.asdict(b) for b in buffers]
  ranked = levers.rank(exp, mem, listed)
  assert ranked[0].setting == "model.loss_chunk=128", ranked
  assert ranked[0].saves >= 2 * 256 * 65536 * 4 // 2      # at least half of one logits buffer
  assert [l.saves for l in ranked] == sorted((l.saves for l in ranked), reverse=True)
  chunked = dataclasses.replace(exp, model=dataclasses.replace(exp.model, loss_chunk=128))
  assert all("loss_chunk" not in l.setting for l in levers.rank(chunked, mem, listed))
  assert "model.loss_chunk=128: ~" in levers.hint(ranked)


@pytest.mark.slow
def test_chunked_loss_frees_the_logits_on_a_tpu_compile(tpu_step):
  """Compiled with model.loss_chunk=128, the [2, 256, 65536] f32 logits are gone from the
  buffer list and device temp falls by at least what the hint promised."""
  from shardax.perf import dry_run, levers
  from shardax.sharding import report
  exp, mem, buffers = tpu_step
  promised = levers.rank(exp, mem, [dataclasses.asdict(b) for b in buffers])[0].saves
  _, setup = dry_run.prepare(_build(*TPU, "model.loss_chunk=128"))
  compiled, chunked = dry_run.compile_with_buffers(setup)
  assert not [b for b in chunked if b.shape == (2, 256, 65536)], chunked[:3]
  assert mem["temp"] - report.memory(compiled)["temp_bytes"] >= promised
