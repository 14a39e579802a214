"""Checkpoints: async, atomic orbax saves of the train state plus the data iterator's state.

One step directory holds two items, `state` (the sharded pytree, via StandardSave) and
`data` (the grain iterator state, via JsonSave), written by one orbax save so both are
committed together: a resumed run never pairs weights with the wrong data position.
Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames on commit (on GCS it writes
`commit_success.txt`), so a save killed halfway is invisible to `latest_step` and is
deleted on the next start (`cleanup_tmp_directories`).

Restore reads onto whatever shardings the abstract state asks for, so a run saved on a
(2, 4) mesh resumes on (8,), (4, 2) or one device. A committed step can still be damaged
later (a truncated or deleted file); restore then warns and falls back to the previous
step instead of killing the job.

Multi-host: every process constructs a Checkpointer and calls should_save/save/restore
with the same steps; orbax runs the barriers and writes each process's shards.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from shardax.configs.schema import CheckpointConfig, ConfigError
from shardax.trainer import jobdir

_policies = ocp.checkpoint_managers


class CheckpointError(RuntimeError):
  """No checkpoint in the directory could be restored."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint holds a different state (another model or optimizer) than asked for."""


def _leaf_shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{path: shape} with path entries reduced to plain names.

  Orbax's metadata tree stores namedtuples (optax states) as dicts and tuples as lists,
  so comparing PyTreeDefs would always differ; names and shapes are what must agree.
  """
  def name(k):
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {tuple(name(k) for k in path): tuple(getattr(leaf, "shape", ()) or ())
          for path, leaf in flat}


def _describe_mismatch(stored: dict, wanted: dict) -> str | None:
  """A short human-readable difference between two `_leaf_shapes` maps, or None."""
  fmt = lambda p: "/".join(p)  # noqa: E731
  missing = [fmt(p) for p in wanted if p not in stored]
  extra = [fmt(p) for p in stored if p not in wanted]
  shapes = [f"{fmt(p)}: checkpoint {stored[p]} vs requested {wanted[p]}"
            for p in wanted if p in stored and stored[p] != wanted[p]]
  parts = [f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
           for label, items in (("not in checkpoint:", missing), ("only in checkpoint:", extra),
                                ("shape differs:", shapes)) if items]
  return "; ".join(parts) or None


class Checkpointer:
  """Saves and restores the train state (+ data iterator state) under `directory`.

  Retention: the newest `cfg.keep` steps, plus every step divisible by `cfg.keep_every`
  forever (orbax preservation policies LatestN + EveryNSteps; a step is kept if either
  policy keeps it). Saves happen only at steps `should_save` accepts, or when forced.
  """

  def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig):
    if cfg.every < 1 or cfg.keep < 1 or (cfg.keep_every is not None and cfg.keep_every < 1):
      raise ConfigError(f"checkpoint.every={cfg.every}, checkpoint.keep={cfg.keep} and "
                        f"checkpoint.keep_every={cfg.keep_every} must be >= 1 (keep_every may be None)")
    self.directory = jobdir.path(directory)   # local or gs://: orbax takes the same epath type
    self.cfg = cfg
    keep = [_policies.LatestN(n=cfg.keep)]
    if cfg.keep_every:
      keep.append(_policies.EveryNSteps(interval_steps=cfg.keep_every))
    options = ocp.CheckpointManagerOptions(
        # Mirrors should_save so that orbax's own should_save agrees with ours; we pass
        # force=True after deciding, which also skips orbax's InitialSavePolicy default.
        save_decision_policy=_policies.AnySavePolicy([
            _policies.FixedIntervalPolicy(cfg.every), _policies.PreemptionCheckpointingPolicy()]),
        preservation_policy=_policies.AnyPreservationPolicy(keep),
        enable_async_checkpointing=cfg.async_save,
        cleanup_tmp_directories=True,   # leftovers of saves killed before their commit
        create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data": ocp.JsonCheckpointHandler()})
    self._sigterm = threading.Event()
    self._orbax_preempted = False
    self._announced = False
    self._bad_steps: set[int] = set()   # committed steps that failed to restore
    self._save_started: float | None = None
    self._prev_handler: Any = None
    self._handler_installed = False
    # Python can only install handlers from the main thread. With several processes,
    # jax.distributed's preemption service owns SIGTERM (a C++ handler we must not
    # replace) and tells every host the same sync step through reached_preemption.
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._handler_installed = True

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self._sigterm.set()   # only set a flag: the loop saves and exits at a step boundary

  def latest_step(self) -> int | None:
    """The newest committed step (it may still turn out unreadable; restore handles that)."""
    return self._manager.latest_step()

  def preempted(self) -> bool:
    """True once SIGTERM arrived or orbax/jax reported a preemption sync point."""
    return self._sigterm.is_set() or self._orbax_preempted

  def should_save(self, step: int) -> bool:
    """Save at multiples of cfg.every, and at any step once preempted.

    Call it at every step on every host: reached_preemption is a collective sync point.
    """
    if not self._orbax_preempted and self._manager.reached_preemption(step):
      self._orbax_preempted = True
    if self.preempted() and not self._announced:
      self._announced = True
      logging.warning("Preemption seen at step %d: saving a checkpoint to %s.", step, self.directory)
    return self.cfg.enabled and (step % self.cfg.every == 0 or self.preempted())

  def save(self, step: int, state, data_state: dict | None = None, force: bool = False) -> bool:
    """Starts an (async) save of `state` and `data_state` as step `step`; True if started.

    With async_save it returns in milliseconds and the write continues in the background;
    `wait()` blocks until it is committed. The caller may donate `state` to the next step
    right away (checked on CPU: later in-place updates do not leak into the checkpoint).
    `force=True` is for the final step and preemption. A step already on disk is not
    rewritten (the last step is often also an interval step) unless restore found it damaged.
    """
    if not self.cfg.enabled:
      return False
    if not (force or step % self.cfg.every == 0 or self.preempted()):
      return False
    if step in self._manager.all_steps():
      if step not in self._bad_steps:
        logging.info("Checkpoint step %d already exists in %s; not saving it again.",
                     step, self.directory)
        return False
      logging.warning("Replacing damaged checkpoint step %d in %s.", step, self.directory)
      self._manager.delete(step)
      self._bad_steps.discard(step)
    start = time.perf_counter()
    saved = self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
    if saved:
      self._save_started = start
      logging.info("Checkpoint step %d: save started in %s, blocked %.2fs%s.", step,
                   self.directory, time.perf_counter() - start,
                   " (async)" if self.cfg.async_save else "")
    return saved

  def _mismatch(self, step: int, abstract_state) -> str | None:
    """Why `abstract_state` cannot be the tree saved at `step` (None: it can, or unknown)."""
    try:
      stored = self._manager.item_metadata(step)["state"].tree
    except Exception:  # unreadable metadata is damage, not a mismatch  # noqa: BLE001
      return None
    return _describe_mismatch(_leaf_shapes(stored), _leaf_shapes(abstract_state))

  def restore(self, abstract_state, step: int | None = None) -> tuple[Any, dict | None]:
    """Returns (state, data_state) from `step`, or from the newest step that restores.

    `abstract_state` has jax.ShapeDtypeStruct leaves whose `sharding` says where each
    array goes; any mesh works, resharding happens on read. A damaged step is skipped
    with a warning. Raises CheckpointMismatchError when the checkpoint holds another
    model, CheckpointError when nothing restores, FileNotFoundError when there is none.
    Multi-host: all processes must see the same damage (shared storage) to pick one step.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"No checkpoint step {step} in {self.directory}; it has {sorted(steps)}.")
      steps = [step]
    failures, mismatches = [], []
    for s in steps:
      try:
        out = self._manager.restore(s, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any read failure means: try an older step
        mismatch = self._mismatch(s, abstract_state)
        reason = f"state does not match the checkpoint: {mismatch}" if mismatch else \
            f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        (mismatches if mismatch else failures).append((s, reason))
        if not mismatch:
          self._bad_steps.add(s)
        logging.warning("Checkpoint step %d in %s cannot be restored (%s)%s", s, self.directory,
                        reason, "; trying the previous step." if s != steps[-1] else ".")
        continue
      if s != steps[0]:
        logging.warning("Restored checkpoint step %d from %s, skipping newer damaged step(s) %s.",
                        s, self.directory, [f for f, _ in failures + mismatches])
      return out["state"], out["data"]
    if mismatches:
      raise CheckpointMismatchError(
          f"The checkpoint in {self.directory} (step {mismatches[0][0]}) was written for a "
          f"different state than this experiment builds ({mismatches[0][1]}). It probably "
          f"belongs to another model or config: use a fresh --job_dir.")
    raise CheckpointError(f"No checkpoint in {self.directory} could be restored: " +
                          "; ".join(f"step {s}: {r}" for s, r in failures))

  def wait(self) -> None:
    """Blocks until every started save is committed (call before exiting or measuring)."""
    self._manager.wait_until_finished()
    if self._save_started is not None:
      logging.info("Checkpoint durable %.2fs after its save started.",
                   time.perf_counter() - self._save_started)
      self._save_started = None

  def close(self) -> None:
    """Waits for pending saves, releases orbax's threads, restores the SIGTERM handler."""
    self.wait()
    self._manager.close()
    if self._handler_installed and threading.current_thread() is threading.main_thread():
      # getsignal() gives None for a handler set outside Python; SIG_DFL is the best we can do.
      signal.signal(signal.SIGTERM, self._prev_handler if self._prev_handler is not None
                    else signal.SIG_DFL)
      self._handler_installed = False

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
