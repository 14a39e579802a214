"""Evaluation through the loop (the periodic eval and `--mode=eval`) reports the model's
cross entropy per target token, with deterministic routing for the MoE LM: not the
training objective (cross entropy + weighted balance/z losses, random second expert).

The reference is computed here from the model's forward pass alone, over the same
validation batches the loop reads, each target token weighted by the loss mask.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest

from shardax import configs
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import checkpoint as ckpt_lib
from shardax.trainer import loop, model_setup
from shardax.trainer import step as step_lib

EVAL_BATCHES = 2


def small_moe():
  cfg = configs.get("moe.tiny")  # 'random' second expert, balance loss weight 1e-2
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=32",
      "model.d_ff=64", "model.max_len=32", "model.moe.d_ff=64",
      "data.seq_len=32", "train.global_batch=8", "train.steps=1", "train.eval_every=1",
      f"train.eval_batches={EVAL_BATCHES}", "train.log_every=1", "checkpoint.every=1",
      "mesh.ici=(8, 1)"])
  return configs.build(cfg)


def test_loop_and_mode_eval_report_cross_entropy_with_deterministic_routing(tmp_path):
  exp = small_moe()
  assert exp.model.moe.second_expert == "random" and exp.model.moe.aux_loss_weight > 0
  summary = loop.train(exp, str(tmp_path))
  mode_eval = loop.evaluate(exp, str(tmp_path))            # --mode=eval on the checkpoint
  setup = model_setup.create(exp, make_mesh(exp.mesh))
  params, _ = ckpt_lib.restore_params(setup, str(tmp_path))  # the weights both evals saw

  def sums(params, batch):
    """Per batch, (loss x targets) of: the cross entropy with both top-2 experts for every
    token and no regularizer (what eval must report); the training objective and its
    cross entropy under random routing (what the regression reported); and the targets."""
    logits, _ = setup.model(params).forward(
        batch["inputs"], batch["positions"], batch["segment_ids"], key=jax.random.key(123),
        deterministic=True)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    loss, metrics = step_lib.loss_fn(setup)(params, batch)
    weight = metrics["loss_weight"]
    return jnp.sum(ce * mask), loss * weight, metrics["ce_loss"] * weight, jnp.sum(mask)

  totals = [0.0] * 4
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    fn = jax.jit(sums)
    for batch in loop._eval_batches(setup):
      totals = [t + float(v) for t, v in zip(totals, jax.device_get(fn(params, batch)))]
  want, objective, random_ce = (t / totals[3] for t in totals[:3])
  assert mode_eval["eval_batches"] == EVAL_BATCHES and mode_eval["eval_weight"] == totals[3]
  assert mode_eval["eval_loss"] == pytest.approx(want, rel=1e-5)
  assert summary["eval_losses"][1] == pytest.approx(want, rel=1e-5)
  # The regression's numbers lie far outside that tolerance.
  assert abs(objective - want) > 1e-3 * want and abs(random_ce - want) > 1e-4 * want


def test_dense_eval_leaves_out_the_z_loss():
  """The dense LM with PaLM's z-loss: eval reports its cross entropy, weighted by targets."""
  import numpy as np
  from meshtools import setup_for
  from shardax.trainer import state as state_lib
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.d_ff=64",
      "model.max_len=16", "data.seq_len=16", "train.global_batch=2", "model.z_loss=0.1"])
  setup = setup_for(configs.build(cfg), jax.devices()[:1])
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  rng = np.random.default_rng(0)
  batch = {"inputs": rng.integers(1, 256, (2, 16)).astype(np.int32),
           "targets": rng.integers(1, 256, (2, 16)).astype(np.int32),
           "segment_ids": np.ones((2, 16), np.int32),
           "positions": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
           "loss_mask": np.concatenate([np.ones((2, 10)), np.zeros((2, 6))], 1).astype(np.float32)}
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    total, weight, _ = jax.device_get(loop.eval_sums_fn(setup)(params, batch))
    loss, metrics = jax.device_get(jax.jit(step_lib.loss_fn(setup))(params, batch))
  assert weight == 20 and metrics["z_loss"] > 1e-3
  assert total / weight == pytest.approx(float(metrics["ce_loss"]), rel=1e-6)
  assert abs(total / weight - float(loss)) > 1e-4


# A checkpoint of moe.deepseek_tiny (shrunk; first dense layer, dropless, balance bias) that the
# MoE LM of 23776dc wrote (params under units/ and first_dense/), with that run's eval loss:
#   shardax --exp=moe.deepseek_tiny --job_dir=... <LEGACY_SETS, then model.transformer.* paths>
LEGACY = os.path.join(os.path.dirname(__file__), "fixtures", "legacy_moe")
LEGACY_SETS = ["model.num_layers=3", "model.d_model=32", "model.num_heads=2", "model.d_ff=64",
               "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff=16",
               "train.global_batch=4", "data.seq_len=32", "model.max_len=32", "train.steps=2",
               "checkpoint.every=2", "train.eval_every=2", "train.eval_batches=2", "mesh.num_cpu_devices=1"]


def test_a_checkpoint_of_the_former_moe_lm_restores_onto_the_one_decoder(tmp_path):
  """Same weights, same eval loss as the run that wrote it (seen failing before
  trainer/legacy_layout.py: 'not in checkpoint: [params/layers/blocks/...]')."""
  job = tmp_path / "job"
  shutil.copytree(LEGACY, job)
  cfg = configs.get("moe.deepseek_tiny")
  configs.apply_overrides(cfg, LEGACY_SETS + ["mesh.num_cpu_devices=None", "mesh.ici=(4, 2)"])  # another mesh
  exp = configs.build(cfg)
  with open(job / "metrics.jsonl") as f:
    want = [json.loads(line) for line in f if "eval_loss" in line][-1]
  got = loop.evaluate(exp, str(job))
  assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-4)
  params, _ = ckpt_lib.restore_params(model_setup.create(exp, make_mesh(exp.mesh)), str(job))
  bias = params["layers"]["blocks"]["moe_block"]["moe"]["balance_bias"]
  assert float(jax.numpy.abs(bias).max()) > 0       # two steps of bias balancing, restored
