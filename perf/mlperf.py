"""MLPerf-style run logs (`job_dir/mllog.txt`) and the time-to-train run.

The log is written with the mlperf-logging package's own `MLLogger`, one
`:::MLLOG {json}` line per event, so the package's parser and compliance checker
read it. The event order is the MLPerf training one:

  cache_clear, init_start, submission_* and hyperparameters   (setup: build, init, compile)
  init_stop, run_start                                        (the clock starts)
  block_start / epoch_start ... epoch_stop / block_stop       (train steps)
  eval_start, eval_accuracy, eval_stop                        (after each block)
  run_stop(status=success | aborted)                          (target reached, or not)

A language model on a token stream has no natural epoch, so, as MLPerf's LLM
benchmarks do, progress is counted in `samples_count` (sequences seen); one
"epoch" here is one eval interval (`train.eval_every` steps), and `eval_accuracy`
carries the validation loss (lower is better; metadata says so).

`time_to_train(exp, job_dir)` trains until the validation loss reaches
`train.target_eval_loss` and reports the wall time from run_start to run_stop.
This is not an MLPerf benchmark: `submission_benchmark` names the experiment.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import jax
from mlperf_logging import mllog
from mlperf_logging.mllog import constants as C

from shardax.configs.schema import Experiment
from shardax.trainer import jobdir

ORG = "shardax"
DIVISION = C.OPEN
STATUS = C.RESEARCH
LOG_NAME = "mllog.txt"


def _precision(dtype: str) -> str:
  return {"float32": "fp32", "bfloat16": "bfloat16"}[dtype]


class RunLog:
  """An `mllog.MLLogger` writing to `path` (and nothing else); only process 0 writes."""

  def __init__(self, path: str):
    self.path = path
    self.enabled = jax.process_index() == 0
    self._logger = logging.getLogger(f"shardax.mllog.{jobdir.path(path)}")
    self._logger.propagate = False
    self._logger.setLevel(logging.INFO)
    self._handler = None
    if self.enabled:
      self._handler = logging.StreamHandler(jobdir.AppendFile(path, truncate=True))
      self._logger.addHandler(self._handler)
    self.ml = mllog.mllog.MLLogger(logger=self._logger, default_stack_offset=2)

  def event(self, key: str, value: Any = None, **metadata) -> None:
    if self.enabled:
      self.ml.event(key, value, metadata=metadata or None)

  def start(self, key: str, value: Any = None, **metadata) -> None:
    if self.enabled:
      self.ml.start(key, value, metadata=metadata or None)

  def end(self, key: str, value: Any = None, **metadata) -> None:
    if self.enabled:
      self.ml.end(key, value, metadata=metadata or None)

  def submission(self, exp: Experiment, mesh_shape: dict[str, int], config_filename: str) -> None:
    """Submission metadata and the hyperparameters MLPerf training rules ask for."""
    dev = jax.devices()[0]
    self.event(C.SUBMISSION_BENCHMARK, exp.name or "shardax")
    self.event(C.SUBMISSION_ORG, ORG)
    self.event(C.SUBMISSION_DIVISION, DIVISION)
    self.event(C.SUBMISSION_STATUS, STATUS)
    self.event(C.SUBMISSION_PLATFORM, f"{jax.device_count()}x{dev.device_kind}")
    t = exp.train
    self.event(C.GLOBAL_BATCH_SIZE, t.global_batch)
    self.event(C.GRADIENT_ACCUMULATION_STEPS, t.microbatches)
    self.event(C.MICRO_BATCH_SIZE, t.global_batch // t.microbatches)
    self.event(C.SEED, t.seed)
    self.event(C.OPT_BASE_LR, exp.optimizer.learning_rate)
    self.event(C.OPT_LR_WARMUP_STEPS, exp.optimizer.warmup_steps)
    self.event(C.MAX_SEQUENCE_LENGTH, exp.data.seq_len)
    self.event(C.TRAIN_SAMPLES, t.steps * t.global_batch)
    self.event(C.EVAL_SAMPLES, (t.eval_batches or 0) * t.global_batch)  # 0: the whole split
    p = _precision(exp.model.dtype)
    self.event(C.LOWEST_NUMERICAL_PRECISION_IN_LINEAR, p)
    self.event(C.LOWEST_NUMERICAL_PRECISION_IN_ATTN, p)
    self.event(C.LOWEST_NUMERICAL_PRECISION_IN_COMM, p)
    self.event(C.TENSOR_PARALLELISM, int(mesh_shape.get("model", 1)))
    self.event(C.PIPELINE_PARALLELISM, int(getattr(getattr(exp.model, "pipeline", None), "stages", 1)))
    self.event(C.CONTEXT_PARALLELISM, 1)
    self.event(C.EXPERT_PARALLELISM, int(mesh_shape.get("expert", 1)))
    self.event(C.CONFIG_FILENAME, config_filename)

  def close(self) -> None:
    if self._handler is not None:
      self._handler.close()
      self._handler.stream.close()   # the job-dir file: on an object store, this uploads it
      self._logger.removeHandler(self._handler)
      self._handler = None


def read(path: str):
  """The log's lines parsed by mlperf-logging's own parser: (loglines, errors)."""
  from mlperf_logging.compliance_checker import mlp_parser
  return mlp_parser.parse_file(path, ruleset="6.1.0")


def check(path: str) -> dict:
  """mlperf-logging's compliance checker, training 6.1.0 common rules, on a log: {} = passes.

  Only the benchmark-agnostic common.yaml runs: its division rule would enqueue the
  per-benchmark files, which accept only the official MLPerf benchmark names (the
  package's CLI checker therefore stops with "open_<name>.yaml" not found).
  Returns the checker's messages keyed by the log key they concern.
  """
  from mlperf_logging.compliance_checker import mlp_compliance
  loglines, errors = read(path)
  if errors:
    return {"parse_errors": errors}
  checker = mlp_compliance.make_checker("training", "6.1.0", quiet=False, werror=False)
  rules = os.path.join(os.path.dirname(mlp_compliance.__file__), "training_6.1.0", "common.yaml")
  checker.configured_checks(loglines, rules)
  mlp_compliance.enqueued_configs.clear()
  return {**checker.overwritable, **dict(enumerate(checker.not_overwritable))}


def start_run(exp: Experiment, job_dir: str):
  """Open the run's MLPerf log (init_start, submission metadata) and build the state setup."""
  from shardax.sharding import make_mesh
  from shardax.trainer import state as state_lib
  log = RunLog(jobdir.path(job_dir) / LOG_NAME)
  log.event(C.CACHE_CLEAR, True)
  log.start(C.INIT_START)
  mesh = make_mesh(exp.mesh)
  setup = state_lib.create(exp, mesh)
  log.submission(exp, dict(mesh.shape), os.path.join(job_dir, "config.json"))
  return log, setup


def time_to_train(exp: Experiment, job_dir: str) -> dict[str, Any]:
  """Train until the eval loss <= train.target_eval_loss; MLPerf log + time_to_train.json."""
  from shardax.sharding import use_rules
  from shardax.trainer.data import inputs
  from shardax.trainer import state as state_lib
  from shardax.trainer import step as step_lib

  t = exp.train
  if t.target_eval_loss is None:
    raise ValueError("time to train needs a target: --set train.target_eval_loss=LOSS")
  log, setup = start_run(exp, job_dir)
  mesh = setup.mesh
  with jax.set_mesh(mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    state = state_lib.init_fn(setup)(jax.random.key(t.seed))
    train_step = step_lib.compile_train_step(setup)
    eval_step = step_lib.eval_step_fn(setup)
    train_iter = inputs.Batches(exp.data, "train", t.global_batch, setup.batch_sharding,
                                seed=exp.data.seed, vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))
    eval_batches = inputs.eval_batches(exp.data, t.global_batch, t.eval_batches,
                                       setup.batch_sharding, vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))
    jax.block_until_ready(eval_step(state["params"], eval_batches[0]))  # compile before the clock
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    t0 = time.perf_counter()
    step, epoch, eval_loss, reached, evals = 0, 0, float("nan"), False, {}
    while step < t.steps and not reached:
      n = min(t.eval_every, t.steps - step)
      samples = step * t.global_batch
      log.start(C.BLOCK_START, samples_count=samples, first_epoch_num=epoch, epoch_count=1)
      log.start(C.EPOCH_START, epoch_num=epoch, samples_count=samples)
      for _ in range(n):
        state, _ = train_step(state, next(train_iter))
      step += n
      samples = step * t.global_batch
      log.end(C.EPOCH_STOP, epoch_num=epoch, samples_count=samples)
      log.end(C.BLOCK_STOP, first_epoch_num=epoch, samples_count=samples)
      log.start(C.EVAL_START, epoch_num=epoch, samples_count=samples)
      eval_loss = float(sum(jax.device_get([eval_step(state["params"], b) for b in eval_batches]))
                        / len(eval_batches))
      evals[step] = eval_loss
      log.event(C.EVAL_ACCURACY, eval_loss, epoch_num=epoch, samples_count=samples,
                metric="eval_loss", lower_is_better=True)
      log.end(C.EVAL_STOP, epoch_num=epoch, samples_count=samples)
      print(f"step {step:>6}/{t.steps} | eval_loss {eval_loss:.4f} (target {t.target_eval_loss})",
            flush=True)
      reached = eval_loss <= t.target_eval_loss
      epoch += 1
    seconds = time.perf_counter() - t0
    log.end(C.RUN_STOP, status=C.SUCCESS if reached else C.ABORTED, samples_count=step * t.global_batch)
  log.close()
  result = {"exp": exp.name, "target_eval_loss": t.target_eval_loss, "reached": reached,
            "time_to_train_s": seconds, "steps": step, "samples": step * t.global_batch,
            "final_eval_loss": eval_loss, "eval_losses": evals,
            "device_kind": jax.devices()[0].device_kind, "device_count": mesh.size}
  if jax.process_index() == 0:
    jobdir.write_text(jobdir.path(job_dir) / "time_to_train.json", json.dumps(result, indent=2))
  return result
