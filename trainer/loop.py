"""The training loop: resume, step, log, evaluate, checkpoint, stop cleanly.

The loop never waits on the device inside a step: per-step metrics stay on
device and are fetched together at each log point, which is also where a
non-finite step (already kept out of the weights in-graph) is noticed.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from shardax.configs.data import IMAGE_SOURCES
from shardax.configs.schema import Experiment
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import checkpoint as ckpt_lib  # noqa
from shardax.trainer import distributed, goodput, jobdir, local_tier, model_setup, moe_drops
from shardax.trainer.data import inputs
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from shardax.trainer.metrics import MetricsWriter


class NonFiniteError(RuntimeError):
  pass


EVAL_PREFIX = "eval_"   # eval's MoE drop figures: 'eval_moe/dropped_copies', ...


def expert_buffer_error(where: str, copies: float) -> NonFiniteError:
  """The error for a dropless MoE step (or eval batch) whose token copies overflowed."""
  return NonFiniteError(
      f"{where}: {copies:g} token copies per MoE layer did not fit the dropless expert-parallel "
      f"buffers (load imbalance); raise --set model.moe.expert_buffer (a multiple of each "
      f"device's fair share), unset it (None: the no-overflow bound), or let such copies drop "
      f"and be counted: --set model.moe.expert_overflow=\"'drop'\"")


def _eval_batches(setup, data=None):
  """The validation batches of `data` (default: the experiment's): the whole split
  (train.eval_batches=None) or its first train.eval_batches, the same at every eval, read
  afresh (nothing held in memory)."""
  exp = setup.exp
  return inputs.iter_eval_batches(data or exp.data, exp.train.global_batch, exp.train.eval_batches,
                                  setup.batch_sharding,
                                  vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))


def eval_sums_fn(setup) -> Callable:
  """A jitted `(params, batch) -> (loss x weight, weight, moe)` of `setup` (a `ModelSetup`
  or the training one): weight = the batch's target tokens (its loss mask) where the model
  reports it, else 1, so batches (and padding) weigh what they hold; moe: {`step.OVERFLOW`:
  the dropless MoE's token copies that did not fit, and for an MoE model each layer's
  routed and dropped copies (`step.COUNTS`)}. The loss is the evaluation loss
  (`step.eval_loss_fn`: for the MoE LM cross entropy with deterministic routing), not the
  training objective."""
  def sums(params, batch):
    loss, metrics = step_lib.eval_loss_and_metrics(setup)(params, batch)
    weight = metrics.pop("loss_weight")
    return loss * weight, weight, metrics
  return jax.jit(sums, in_shardings=(setup.param_shardings, setup.batch_sharding),
                 out_shardings=setup.replicated)


def _eval(eval_sums, params, batches, targets_per_byte: float | None, model=None) -> dict[str, float]:
  """Loss per target token over `batches` (one host sync at the end) and, for text,
  bits per byte: loss x targets per byte / ln 2 (comparable across tokenizers). A
  dropless MoE's buffer overflow raises as in training (its loss would be NaN). An MoE
  `model` (its config) adds the token copies routing dropped (`moe_drops.scalars`,
  'eval_moe/...'): the loss of a model that drops is not hidden behind a plain number."""
  total = weight = jnp.float32(0.0)
  moe = None
  n = 0
  for batch in batches:
    s, w, o = eval_sums(params, batch)
    total, weight, n = total + s, weight + w, n + 1
    moe = o if moe is None else jax.tree.map(jnp.add, moe, o)
  total, weight, moe = float(total), float(weight), jax.device_get(moe or {})
  overflow = float(moe.get(step_lib.OVERFLOW, 0.0))
  if overflow > 0:
    raise expert_buffer_error(f"eval ({n} batches)", overflow)
  out = {"eval_loss": total / max(weight, 1.0), "eval_weight": weight, "eval_batches": n}
  drops = moe_drops.of_metrics([moe])
  if drops is not None and model is not None:
    out.update(moe_drops.scalars(drops, model, prefix=EVAL_PREFIX))
  if targets_per_byte is not None:
    out["eval_bits_per_byte"] = out["eval_loss"] * targets_per_byte / math.log(2)
  return out


def _eval_sources(eval_sums, params, setup) -> dict[str, float]:
  """`_eval` of the experiment's data; for a mixture, of each source's validation split
  ('eval_loss/<source>', 'eval_bits_per_byte/<source>', 'eval_weight/<source>') and in
  total, weighted by tokens, never by batches: the total loss is all nats over all target
  tokens, the total bits per byte all nats over all bytes (a source's bytes = its tokens
  / its targets per byte), so a source with short batches or a padded tail counts for
  what it holds."""
  data, model = setup.exp.data, setup.exp.model
  if not data.mixture:
    return _eval(eval_sums, params, _eval_batches(setup), inputs.targets_per_byte(data), model)
  out: dict[str, float] = {}
  nats = weight = text_bytes = 0.0
  batches = 0
  routed = dropped = 0.0
  sources = [src for src, _ in data.components]
  for src, name in zip(sources, inputs.source_labels(sources)):
    one = data.for_source(src)
    per_byte = inputs.targets_per_byte(one)
    e = _eval(eval_sums, params, _eval_batches(setup, one), per_byte, model)
    routed += e.get(EVAL_PREFIX + step_lib.ROUTED, 0.0)
    dropped += e.get(EVAL_PREFIX + step_lib.DROPPED, 0.0)
    out.update({f"eval_loss/{name}": e["eval_loss"], f"eval_weight/{name}": e["eval_weight"],
                f"eval_bits_per_byte/{name}": e["eval_bits_per_byte"]})
    nats += e["eval_loss"] * e["eval_weight"]
    weight += e["eval_weight"]
    text_bytes += e["eval_weight"] / per_byte
    batches += e["eval_batches"]
  if routed:   # all sources' copies together (each layer's share is per source only)
    out.update({EVAL_PREFIX + moe_drops.FRACTION: dropped / routed,
                EVAL_PREFIX + step_lib.ROUTED: routed, EVAL_PREFIX + step_lib.DROPPED: dropped})
  return {"eval_loss": nats / max(weight, 1.0), "eval_weight": weight, "eval_batches": batches,
          "eval_bits_per_byte": nats / max(text_bytes, 1e-9) / math.log(2), **out}


def format_eval(step: int, total_steps: int, exp: Experiment, e: dict[str, float]) -> str:
  """One line: the loss, bits per byte, the share of MoE token copies dropped (when not 0),
  and what the eval covered."""
  what = ("whole validation split" if exp.train.eval_batches is None
          else f"first {exp.train.eval_batches} validation batches")
  bpb = f" | bits/byte {e['eval_bits_per_byte']:.4f}" if "eval_bits_per_byte" in e else ""
  sources = "".join(f" | {k.split('/', 1)[1]}: {v:.4f} bits/byte" for k, v in e.items()
                    if k.startswith("eval_bits_per_byte/"))
  dropped = moe_drops.note(e.get(EVAL_PREFIX + moe_drops.FRACTION, 0.0))
  return (f"step {step:>6}/{total_steps} | eval_loss {e['eval_loss']:.4f}{bpb}{dropped} "
          f"({what}: {e['eval_batches']} batches, {e['eval_weight']:.0f} tokens){sources}")


def _status(line: str) -> None:
  logging.info(line)
  print(line, file=sys.stderr, flush=True)  # a status line: shown on the quiet terminal too


def _from_local(setup, local, persistent: int | None, rec):
  """(state, data state) from the local tier when every process holds a step complete that
  is at least as new as the job dir's and reads it back, else None; logs the choice."""
  tier, step, why = local_tier.agree(local, persistent)
  restored = None
  if tier == "local":
    rec.switch("restore_local")
    error = None
    try:
      restored = local.restore(step, setup.abstract)
    except Exception as e:  # noqa: BLE001 - a local disk's fault: the job dir still has a step
      error = f"{type(e).__name__}: {e}"
    if distributed.any_process(restored is None):   # never half a job from the local tier
      restored, why = None, f"local step {step} did not restore on every process ({error or 'a peer failed'})"
  local.discard(restored=step if restored is not None else None)   # no other history stays behind
  if restored is not None:
    _status(f"restore: local tier, step {step}: {why}")
  elif persistent is not None:
    _status(f"restore: persistent tier, step {persistent}: {why}")
  else:
    _status(f"restore: no checkpoint in either tier ({why}); starting from step 0")
  return restored


def restore_or_init(setup, checkpointer, data_iter, rec: goodput.Recorder,
                    local: local_tier.LocalTier | None = None):
  """The newest checkpoint (the local tier's, trainer/local_tier.py, when every process holds
  it complete and it is at least as new as the job dir's; else the job dir's), else a fresh
  sharded init. The data iterator's state comes back with the model's, from the same tier."""
  persistent = checkpointer.latest_step() if checkpointer is not None else None
  restored, tier = (_from_local(setup, local, persistent, rec), "local") if local is not None else (None, None)
  if restored is None and persistent is not None:
    rec.switch("restore_persistent")
    restored, tier = checkpointer.restore(setup.abstract), "persistent"
  if restored is None:
    return state_lib.init_fn(setup)(jax.random.key(setup.exp.train.seed))
  state, data_state = restored
  step = int(state["step"])
  if data_iter is not None and data_state is not None:
    t0 = time.perf_counter()
    replayed = data_iter.set_state(data_state)
    _status(f"process {jax.process_index()} restored its data state at step {step}, "
            f"{replayed} batches replayed ({time.perf_counter() - t0:.2f}s)")
  _status(f"resumed from step {step}")
  rec.info["restored"] = {"tier": tier, "step": step}
  rec.switch("startup")
  return state


def evaluate(exp: Experiment, job_dir: str) -> dict[str, float]:
  """Validation loss per token (and bits per byte) of the latest checkpoint in `job_dir`,
  from the params alone (`checkpoint.restore_params`): no optimizer is built."""
  check_tokenizer(exp)
  setup = model_setup.create(exp, make_mesh(exp.mesh))
  params, _ = ckpt_lib.restore_params(setup, job_dir)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    return _eval_sources(eval_sums_fn(setup), params, setup)


def check_tokenizer(exp: Experiment) -> None:
  """The model's vocabulary must hold the tokenizer's ids (prepares the data if needed)."""
  if hasattr(exp.model, "vocab_size") and exp.data.source != "synthetic" \
     and exp.data.source not in IMAGE_SOURCES:
    from shardax.trainer.data import preparation, tokenizers
    tokenizers.check_vocab(preparation.load_tokenizer(exp.data), exp.model.vocab_size, exp.data.tokenizer)


def train(exp: Experiment, job_dir: str, on_ready: Callable[[], None] | None = None,
          recorder: goodput.Recorder | None = None) -> dict[str, Any]:
  """Train `exp` in `job_dir` (resuming from its checkpoints); returns a summary.

  `on_ready` runs once the state is built or restored, i.e. once the config is known
  to fit this job dir: the CLI writes the resolved config there, and not before.
  `recorder`: the run's goodput timeline (trainer/goodput.py; the CLI's starts at its
  process's start), default one starting now.
  """
  rec = recorder or goodput.Recorder(job_dir, write=distributed.is_primary(), started=time.time())
  mesh = make_mesh(exp.mesh)
  setup = state_lib.create(exp, mesh)
  with jax.set_mesh(mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    # Data first: a missing dataset must fail before anything is created in the job dir.
    with rec.during("data"):
      check_tokenizer(exp)
      train_iter = inputs.Batches(exp.data, "train", exp.train.global_batch, setup.batch_sharding,
                                  seed=exp.data.seed, vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))
    # the job dir's identity, written with its first files: what the local tier's steps belong to
    identity = jobdir.identity(job_dir, distributed.is_primary(), sync=lambda: distributed.any_process(False))
    checkpointer = (ckpt_lib.Checkpointer(os.path.join(job_dir, "checkpoints"), exp.checkpoint)
                    if exp.checkpoint.enabled else None)
    local = (local_tier.LocalTier(exp.checkpoint.local_dir, exp.checkpoint.local_every, job_dir, identity,
                                  keep=exp.checkpoint.local_keep, persistent=checkpointer)
             if exp.checkpoint.local_dir and exp.checkpoint.enabled else None)
    state = restore_or_init(setup, checkpointer, train_iter, rec, local)
    if on_ready is not None:
      on_ready()
    train_step = step_lib.train_step_fn(setup)
    eval_sums = eval_sums_fn(setup)
    writer = MetricsWriter(job_dir, exp.train.steps)
    tokens_per_step = exp.train.global_batch * exp.model.tokens_per_example(exp.data)
    flops_per_device = exp.train.global_batch * exp.model.flops_per_example(exp.data) / mesh.size
    start = int(state["step"])
    rec.info["start_step"] = start
    logging.info("training %s: %s params, steps %d -> %d on mesh %s",
                 exp.name, f"{state_lib.count_params(setup):,}", start, exp.train.steps, dict(mesh.shape))
    summary: dict[str, Any] = {"start_step": start, "losses": {}, "eval_losses": {}, "skipped_steps": [],
                               "eval_bits_per_byte": {}, "dropped_copies": {}}
    drop_warning = moe_drops.OnceWarning(exp.model)
    pending: list[tuple[int, dict]] = []
    t0 = time.perf_counter()
    step = start
    # train.profile_steps=(first, last): a jax profiler trace of those steps in job_dir/profile
    trace_first, trace_last = exp.train.profile_steps or (0, 0)
    tracing = False
    def run_eval(at: int) -> None:
      with rec.during("eval"):
        e = _eval_sources(eval_sums, state["params"], setup)
      summary["eval_losses"][at] = e["eval_loss"]
      if "eval_bits_per_byte" in e:
        summary["eval_bits_per_byte"][at] = e["eval_bits_per_byte"]
      writer.write(at, {k: v for k, v in e.items() if k != "eval_batches"})
      logging.info(line := format_eval(at, exp.train.steps, exp, e))
      print(line, flush=True)

    if start == 0:  # the untrained model's eval loss: the baseline the run improves on
      run_eval(0)
    try:
      while step < exp.train.steps:
        if step + 1 == trace_first:
          jobdir.start_trace(jobdir.path(job_dir) / "profile")
          tracing = True
        rec.step(step + 1)
        with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):  # names the step in traces
          state, metrics = train_step(state, next(train_iter))
        step += 1
        if tracing and step >= trace_last:
          jax.block_until_ready(state)
          jobdir.stop_trace()
          tracing = False
        pending.append((step, metrics))
        last = step == exp.train.steps
        if step % exp.train.log_every == 0 or last or (checkpointer and checkpointer.should_save(step)):
          _log(writer, pending, exp, summary, tokens_per_step, flops_per_device, drop_warning)
          pending = []
        if step % exp.train.eval_every == 0 or last:
          run_eval(step)
          writer.reset_clock()
        if checkpointer is not None and (checkpointer.should_save(step) or last):
          with rec.during("checkpoint"):
            checkpointer.save(step, state, train_iter.get_state(), force=last or checkpointer.preempted())
          writer.reset_clock()
          rec.flush(force=True)   # a run killed later still leaves its record up to here
          if checkpointer.preempted():
            logging.warning("preempted: saved step %d, exiting", step)
            summary["preempted"] = True
            break
        elif local is not None and local.should_save(step):   # the cheap tier, between persistent saves
          with rec.during("checkpoint"):
            local.save(step, state, train_iter.get_state())
        rec.flush()   # throttled to goodput.FLUSH_S: a clock check on most steps
      rec.switch("checkpoint")   # the last save's wait blocks
      if checkpointer is not None:
        checkpointer.wait()
      if local is not None and not summary.get("preempted"):
        local.remove()   # finished: the job dir holds the last step; local copies would only hold RAM
      elif local is not None:
        local.wait()
      rec.switch("other")
    finally:
      if tracing:
        jobdir.stop_trace()
      if checkpointer is not None:
        checkpointer.wait()
        checkpointer.close()
      writer.close()
      status = "failed" if sys.exc_info()[0] else "preempted" if summary.get("preempted") else "finished"
      summary["goodput"] = rec.flush(status, force=True)
    summary.update(final_step=step, seconds=time.perf_counter() - t0, state=state)
    if rec.write_file:   # the records it just wrote: the earlier runs' and this one's
      logging.info(line := goodput.format_report(rec.previous + [summary["goodput"]]))
      print(line, file=sys.stderr, flush=True)
    return summary


def _log(writer, pending, exp, summary, tokens_per_step, flops_per_device, drop_warning=None) -> None:
  """Every step's metrics since the last log point, fetched at once: the last step's
  scalars, the window's MoE drops summed over all its steps (`moe_drops`; in
  summary['dropped_copies'] by the window's last step), the progress line."""
  fetched = jax.device_get([m for _, m in pending])
  for (step, _), m in zip(pending, fetched):
    summary["losses"][step] = float(m["loss"])
    if m.get(step_lib.OVERFLOW, 0) > 0:   # its step was poisoned, never applied
      raise expert_buffer_error(f"step {step}", m[step_lib.OVERFLOW])
    if not m["finite"]:
      summary["skipped_steps"].append(step)
      logging.warning("step %d: non-finite loss %s / grad norm %s; update skipped",
                      step, m["loss"], m["grad_norm"])
      if exp.train.nonfinite == "stop":
        raise NonFiniteError(
            f"step {step}: loss {m['loss']} or grad norm {m['grad_norm']} is not finite "
            f"(train.nonfinite='stop'); the last checkpoint before it is intact. Lower "
            f"optimizer.learning_rate or set --set train.nonfinite=skip to skip such steps")
  step, last = pending[-1][0], fetched[-1]
  drops = moe_drops.of_metrics(fetched)
  if drops is not None:
    summary["dropped_copies"][step] = drops.fraction
    if drop_warning is not None:
      drop_warning.check(pending[0][0], step, drops)
  rates = writer.progress(step, float(last["loss"]), tokens_per_step,
                          moe_drops.note(drops.fraction) if drops is not None else "")
  scalars = {"loss": last["loss"], "learning_rate": last["learning_rate"], "grad_norm": last["grad_norm"],
             "skipped_steps": len(summary["skipped_steps"])}
  if drops is not None:
    scalars.update(moe_drops.scalars(drops, exp.model))
  scalars.update({k: v for k, v in last.items() if k not in scalars and k != "finite" and np.ndim(v) == 0})
  if rates:
    scalars["tokens_per_s"] = rates["tokens_per_s"]
    scalars["tflops_per_device"] = rates["steps_per_s"] * flops_per_device / 1e12
  writer.write(step, scalars)
