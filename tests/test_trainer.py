"""End to end on the simulated 2 x 4 mesh: train, log, checkpoint, resume, reshard."""

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

import clitools
from shardax import configs
from shardax.sharding import make_mesh
from shardax.trainer import checkpoint as ckpt_lib
from shardax.trainer import loop
from shardax.trainer import state as state_lib

STEPS = 8
SMALL_OVERRIDES = [
    "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.d_ff=128",
    "model.max_len=32", "data.seq_len=32", "train.global_batch=8", f"train.steps={STEPS}",
    "train.eval_every=4", "train.eval_batches=2", "train.log_every=2", "checkpoint.every=4",
    "optimizer.warmup_steps=2", "optimizer.learning_rate=3e-3",
    "mesh.ici=(2, 4)", "sharding.preset='2d'"]


def small_experiment(tmp_data_dir, *overrides):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, SMALL_OVERRIDES + [f"data.data_dir={tmp_data_dir!r}", *overrides])
  return configs.build(cfg)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, data_dir):
  job = str(tmp_path_factory.mktemp("job"))
  summary = loop.train(small_experiment(data_dir), job)
  return job, summary


def test_short_run_lowers_loss_and_writes_everything(full_run):
  job, summary = full_run
  assert summary["final_step"] == STEPS
  evals = list(summary["eval_losses"].values())
  assert sorted(summary["eval_losses"]) == [0, 4, 8] and evals[-1] < evals[0]
  lines = [json.loads(l) for l in open(os.path.join(job, "metrics.jsonl"))]
  train_lines = [l for l in lines if "loss" in l]
  assert [l["step"] for l in train_lines] == [2, 4, 6, 8]
  for key in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "tflops_per_device"):
    assert key in train_lines[-1], key
  assert any("eval_loss" in l for l in lines)
  assert sorted(os.listdir(os.path.join(job, "checkpoints"))) == ["4", "8"]
  assert os.listdir(os.path.join(job, "tensorboard"))


def test_resumed_run_repeats_the_uninterrupted_losses(full_run, data_dir, tmp_path):
  job, summary = full_run
  # A run that stopped after step 4: its job dir holds only the step-4 checkpoint.
  resumed_job = str(tmp_path / "resumed")
  os.makedirs(os.path.join(resumed_job, "checkpoints"))
  shutil.copytree(os.path.join(job, "checkpoints", "4"), os.path.join(resumed_job, "checkpoints", "4"))
  resumed = loop.train(small_experiment(data_dir), resumed_job)
  assert resumed["start_step"] == 4
  for step in range(5, STEPS + 1):
    np.testing.assert_allclose(resumed["losses"][step], summary["losses"][step], rtol=1e-6)


@pytest.mark.parametrize("ici", [(8, 1), (1, 1)])
def test_checkpoint_from_2x4_restores_on_other_meshes(full_run, data_dir, ici):
  job, summary = full_run
  exp = small_experiment(data_dir, f"mesh.ici={ici!r}")
  devices = jax.devices()[: ici[0] * ici[1]]
  mesh = make_mesh(exp.mesh, devices)
  setup = state_lib.create(exp, mesh)
  with ckpt_lib.Checkpointer(os.path.join(job, "checkpoints"), exp.checkpoint) as ck:
    state, _ = ck.restore(setup.abstract)
  want = jax.device_get(summary["state"]["params"])
  got = jax.device_get(state["params"])
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  leaf = jax.tree.leaves(state["params"])[0]
  assert leaf.sharding.mesh.devices.size == len(devices)


def test_decode_continues_prompts_from_the_checkpoint(full_run, data_dir):
  """The trained 2 x 4 checkpoint decodes a batch of prompts greedily; each new token is
  the argmax of a full forward pass, and the completions land in the job dir as JSONL."""
  from shardax.trainer import decode
  from shardax.trainer.data import corpus
  job, summary = full_run
  exp = small_experiment(data_dir)
  texts = ["import os\n", "def ", "class Foo(object):\n    "]
  completions = decode.from_job_dir(exp, job, texts, decode.Sampling(max_new_tokens=6))
  assert [c.prompt for c in completions] == texts
  setup, state = loop.restore_latest(exp, job)
  with jax.set_mesh(setup.mesh):
    for c in completions:
      assert c.finish_reason == "length" and len(c.ids) == 6
      ids = list(corpus.encode(c.prompt)) + c.ids
      logits = setup.model(state["params"])(np.asarray([ids], np.int32))[0]
      np.testing.assert_array_equal(np.argmax(logits[len(ids) - 7:-1], -1), c.ids)
      assert c.text == corpus.decode(np.asarray(c.ids))
  lines = [json.loads(l) for l in open(os.path.join(job, "completions.jsonl"))]
  assert [l["prompt"] for l in lines] == texts and lines[0]["ids"] == completions[0].ids
  # The command line: the same prompts from a JSONL file, the same completions on stdout.
  os.remove(os.path.join(job, "completions.jsonl"))
  prompts_file = os.path.join(job, "prompts.jsonl")
  with open(prompts_file, "w") as f:
    f.writelines(json.dumps({"prompt": t}) + "\n" for t in texts)
  args = [sys.executable, "-m", "shardax.main", "--exp=lm.tiny", f"--job_dir={job}", "--mode=decode",
          f"--prompts_file={prompts_file}", "--max_new_tokens=6"]
  for override in SMALL_OVERRIDES + [f"data.data_dir={data_dir!r}"]:
    args += ["--set", override]
  proc = clitools.run(args, devices=8)
  assert proc.returncode == 0, proc.stderr[-2000:]
  want = [c.to_json() for c in completions]
  assert proc.stdout.strip().splitlines() == want
  assert open(os.path.join(job, "completions.jsonl")).read().splitlines() == want
