"""Checkpoints: async, atomic orbax saves of the train state plus the data iterator's state.

One step directory holds two items, `state` (the sharded pytree, via StandardSave) and
`data_states` (every process's data iterator state, one JSON file per process named as
grain's own handler names them, `process_<i>-of-<n>.json`), written by one orbax save so
both are committed together: a resumed run never pairs weights with the wrong data
position, and every process resumes its own readers without reading anything twice.
(grain's `grain.checkpoint.CheckpointHandler` writes the same files but reads them back
only on the same process count and takes the live iterator; ours takes the state the
loop captured at the step and, on another count, hands the iterator every process's
state so it can reassemble its readers; steps written before it keep a `data` item,
read as before.)
Orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames on commit (on GCS it writes
`commit_success.txt`), so a save killed halfway is invisible to `latest_step` and is
deleted on the next start (`cleanup_tmp_directories`).

Restore reads onto whatever shardings the abstract state asks for, so a run saved on a
(2, 4) mesh resumes on (8,), (4, 2) or one device. Restores that agree:

- a read error is retried with backoff (object stores fail transiently); a step is
  skipped only when proven damaged (a required file missing, or the same damage error,
  not-found / data-loss / out-of-range / undecodable, on a second read); it is then moved
  aside into `damaged/<step>-<time>` (never deleted) and the previous step is tried;
- an error that persists but proves nothing stops the job naming the step: rolling back
  because storage hiccupped would throw away progress;
- every process restores the same step: the newest step each sees, and each attempt's
  outcome, go through a small all-gather; processes that disagree stop the job with the
  step each one saw.

`restore_params` reads the params alone (eval, decode, export), never the optimizer state.

Multi-host: every process constructs a Checkpointer and calls should_save/save/restore
with the same steps; orbax runs the barriers and writes each process's shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from shardax.configs.schema import CheckpointConfig, ConfigError
from shardax.trainer import distributed, jobdir, legacy_layout

_policies = ocp.checkpoint_managers


class CheckpointError(RuntimeError):
  """No checkpoint in the directory could be restored."""


class CheckpointMismatchError(CheckpointError):
  """The checkpoint holds a different state (another model or optimizer) than asked for."""


def state_file(index: int, count: int) -> str:
  """One process's data state file in a step's `data_states` item (grain's naming)."""
  return f"process_{index}-of-{count}.json"


class DataStatesHandler(ocp.AsyncCheckpointHandler):
  """Every process writes its own iterator state (a JSON dict), in the step's commit.

  Restore returns this process's state when the step was written by as many processes,
  else `[state of process 0, 1, ...]` of the writers: the iterator decides what it can
  rebuild from them (trainer/data/inputs.py `Batches.set_state`).
  """

  async def async_save(self, directory: epath.Path, item=None, args=None):
    text = json.dumps(args.item)
    name = state_file(jax.process_index(), jax.process_count())
    async def write():
      (directory / name).write_text(text)
    return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="data_states_save")]

  def save(self, directory: epath.Path, item=None, args=None):
    (directory / state_file(jax.process_index(), jax.process_count())).write_text(json.dumps(args.item))

  def restore(self, directory: epath.Path, item=None, args=None):
    own = directory / state_file(jax.process_index(), jax.process_count())
    if own.exists():
      return json.loads(own.read_text())
    found = {}
    for f in directory.iterdir():
      if m := re.fullmatch(r"process_(\d+)-of-(\d+)\.json", f.name):
        found[int(m.group(1))] = (int(m.group(2)), f)
    counts = {n for n, _ in found.values()}
    if len(counts) != 1 or sorted(found) != list(range(counts.pop())):
      raise FileNotFoundError(f"{directory}: the data states are incomplete "
                              f"({sorted(f.name for _, f in found.values())})")
    return [json.loads(found[i][1].read_text()) for i in sorted(found)]

  def structure(self, directory):
    return None

  def metadata(self, directory):
    return None

  def finalize(self, directory):
    pass

  def close(self):
    pass


@ocp.args.register_with_handler(DataStatesHandler, for_save=True)
@dataclasses.dataclass
class DataStatesSave(ocp.args.CheckpointArgs):
  item: Any


@ocp.args.register_with_handler(DataStatesHandler, for_restore=True)
@dataclasses.dataclass
class DataStatesRestore(ocp.args.CheckpointArgs):
  item: Any = None


# Read errors that prove a step damaged when they repeat (tensorstore status names and
# what orbax/json raise for a missing or garbled file); anything else may be transient.
_DAMAGE = re.compile(r"NOT_FOUND|DATA_LOSS|OUT_OF_RANGE|not found|No such file|does not exist|"
                     r"Expecting value|JSONDecodeError|Unterminated string|incomplete", re.I)
RETRIES = 4           # reads of one step before giving up on it (damage is proven on the 2nd)
BACKOFF_S = 0.5       # first wait between reads; doubles each time


def _chain_text(e: BaseException) -> str:
  """The error and its causes (orbax wraps tensorstore's status in a plain Exception)."""
  parts, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    parts.append(f"{type(e).__name__}: {e}")
    e = e.__cause__ or e.__context__
  return " <- ".join(parts)


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


def _describe_mismatch(stored: dict, wanted: dict, partial: bool = False) -> str | None:
  """A short human-readable difference between two `_leaf_shapes` maps, or None (`partial`:
  `wanted` is a subtree of what was stored, so leaves only in the checkpoint are fine)."""
  fmt = lambda p: "/".join(p)  # noqa: E731
  missing = [fmt(p) for p in wanted if p not in stored]
  extra = [] if partial else [fmt(p) for p in stored if p not in wanted]
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
                       "data_states": DataStatesHandler(),
                       "data": ocp.JsonCheckpointHandler()})   # steps saved before data_states
    self._sigterm = threading.Event()
    self._orbax_preempted = False
    self._announced = False
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
    """The newest committed step (it may still turn out unreadable; restore handles that);
    after this run's `save` of a step, that step, from the save's start (orbax lists it then:
    the local tier records it as the step its later states descend from)."""
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
    rewritten (the last step is often also an interval step); a damaged one was moved
    aside by restore, so it is written afresh.
    """
    if not self.cfg.enabled:
      return False
    if not (force or step % self.cfg.every == 0 or self.preempted()):
      return False
    if step in self._manager.all_steps():
      logging.info("Checkpoint step %d already exists in %s; not saving it again.",
                   step, self.directory)
      return False
    start = time.perf_counter()
    saved = self._manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data_states=DataStatesSave(data_state)))
    if saved:
      self._save_started = start
      logging.info("Checkpoint step %d: save started in %s, blocked %.2fs%s.", step,
                   self.directory, time.perf_counter() - start,
                   " (async)" if self.cfg.async_save else "")
    return saved

  def _stored(self, step: int) -> dict | None:
    """`_leaf_shapes` of the state saved at `step`, None when its metadata is unreadable
    (damage, which the read reports, not a mismatch)."""
    try:
      return _leaf_shapes(self._manager.item_metadata(step)["state"].tree)
    except Exception:  # noqa: BLE001
      return None

  def _mismatch(self, step: int, abstract_state, partial: bool = False) -> str | None:
    """Why `abstract_state` cannot be the tree saved at `step` (None: it can, or unknown)."""
    stored = self._stored(step)
    if stored is None:
      return None
    if legacy_layout.is_legacy(stored):
      abstract_state = legacy_layout.to_legacy(abstract_state)
    return _describe_mismatch(stored, _leaf_shapes(abstract_state), partial)

  def _read(self, step: int, abstract_state, partial: bool = False):
    """One read of `step`: (state, data state) as `restore` returns them. A step in the
    former MoE layout is read in that layout and renamed (trainer/legacy_layout.py)."""
    if legacy_layout.is_legacy(self._stored(step) or {}):
      state, data = self._read_as(step, legacy_layout.to_legacy(abstract_state), partial)
      return legacy_layout.from_legacy(state), data
    return self._read_as(step, abstract_state, partial)

  def _read_as(self, step: int, abstract_state, partial: bool = False):
    step_dir = self.directory / str(step)
    if partial:   # orbax's partial restore: the leaves not asked for are never read
      handler = ocp.PyTreeCheckpointHandler()
      try:
        return handler.restore(step_dir / "state", args=ocp.args.PyTreeRestore(
            item=abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
            partial_restore=True)), None
      finally:
        handler.close()
    data = "data_states" if (step_dir / "data_states").exists() or not (step_dir / "data").exists() \
        else "data"
    args = {"state": ocp.args.StandardRestore(abstract_state),
            data: DataStatesRestore() if data == "data_states" else ocp.args.JsonRestore()}
    out = self._manager.restore(step, args=ocp.args.Composite(**args))
    return out["state"], out[data]

  def _missing_files(self, step: int) -> str | None:
    """The files every committed step has that `step` lacks, or None."""
    step_dir = self.directory / str(step)
    need = [step_dir / "state" / "_METADATA", step_dir / "state" / "manifest.ocdbt"]
    missing = [os.fspath(p.relative_to(step_dir)) for p in need if not p.exists()]
    return f"missing {missing}" if missing else None

  def _attempt(self, step: int, abstract_state, partial: bool = False) -> tuple[str, Any]:
    """Reads `step` with retries: ("ok", (state, data)), ("damaged", why),
    ("mismatch", why) or ("unreadable", why)."""
    last = last_kind = None
    for attempt in range(RETRIES):
      try:
        return "ok", self._read(step, abstract_state, partial)
      except Exception as e:  # noqa: BLE001 - classified below
        text = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if mismatch := self._mismatch(step, abstract_state, partial):
          return "mismatch", f"state does not match the checkpoint: {mismatch}"
        if missing := self._missing_files(step):
          return "damaged", missing
        damage = _DAMAGE.search(_chain_text(e))
        kind = damage.group(0).upper() if damage else None
        if kind and kind == last_kind:   # the files' fault twice in a row: not a hiccup
          return "damaged", f"{text} ({kind} again on a second read)"
        last, last_kind = text, kind
        if attempt + 1 < RETRIES:
          wait = BACKOFF_S * 2 ** attempt
          logging.warning("Checkpoint step %d in %s: read failed (%s); retrying in %.1fs "
                          "(%d of %d).", step, self.directory, text, wait, attempt + 1, RETRIES - 1)
          time.sleep(wait)
    return "unreadable", f"{last} after {RETRIES} reads, and its files look intact"

  def _move_aside(self, step: int) -> epath.Path:
    """Renames a damaged step into `damaged/` (process 0; nothing is deleted)."""
    target = self.directory / "damaged" / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
    n = 1
    while target.exists():   # the same step damaged again within the second
      target, n = target.with_name(f"{step}-{time.strftime('%Y%m%dT%H%M%S')}.{n}"), n + 1
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      (self.directory / str(step)).rename(target)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"shardax_move_aside_{step}")
    self._manager.reload()
    return target

  def restore(self, abstract_state, step: int | None = None, partial: bool = False) -> tuple[Any, Any]:
    """Returns (state, data state) from `step`, or from the newest step that restores.

    `partial=True`: `abstract_state` is a subtree of the saved state (e.g. {"step", "params"}:
    eval, decode and export need no optimizer moments); only its leaves are read, and the
    data state is None.

    `abstract_state` has jax.ShapeDtypeStruct leaves whose `sharding` says where each
    array goes; any mesh works, resharding happens on read. The data state is this
    process's (a dict), or every writer's (a list) when another process count wrote it.
    Raises CheckpointMismatchError when the checkpoint holds another model, CheckpointError
    when nothing restores, a step stays unreadable or the processes disagree,
    FileNotFoundError when there is none.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    seen = distributed.allgather([steps[0] if steps else -1])[:, 0]
    if len(set(seen.tolist())) > 1:
      raise CheckpointError(f"the processes see different newest checkpoints in {self.directory}: " +
                            ", ".join(f"process {i}: step {s}" for i, s in enumerate(seen.tolist())) +
                            "; every process must read the same job dir")
    if not steps:
      raise FileNotFoundError(f"No checkpoint in {self.directory}.")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"No checkpoint step {step} in {self.directory}; it has {sorted(steps)}.")
      steps = [step]
    codes = ("ok", "damaged", "unreadable", "mismatch")
    damaged = []
    for s in steps:
      outcome, value = self._attempt(s, abstract_state, partial)
      everyone = distributed.allgather([s, codes.index(outcome)])
      if len(set(everyone[:, 0].tolist())) > 1:
        raise CheckpointError("the processes restore different checkpoint steps: " + ", ".join(
            f"process {i}: step {x}" for i, x in enumerate(everyone[:, 0].tolist())))
      worst = codes[int(everyone[:, 1].max())]
      if worst == "ok":
        if damaged:
          logging.warning("Restored checkpoint step %d from %s; newer damaged step(s) moved aside: %s.",
                          s, self.directory, damaged)
        return value
      who = [i for i, c in enumerate(everyone[:, 1].tolist()) if codes[c] == worst]
      why = value if outcome == worst else f"seen by process(es) {who}"
      if worst == "mismatch":
        raise CheckpointMismatchError(
            f"The checkpoint in {self.directory} (step {s}) was written for a "
            f"different state than this experiment builds ({why}). It probably "
            f"belongs to another model or config: use a fresh --job_dir.")
      if worst == "unreadable":
        raise CheckpointError(
            f"Checkpoint step {s} in {self.directory} cannot be read ({why}); not rolling back "
            f"to an older step over what may be a storage outage: rerun when the storage answers")
      target = self._move_aside(s)
      damaged.append(s)
      logging.warning("Checkpoint step %d in %s cannot be restored (%s); moved aside to %s%s", s,
                      self.directory, why, target, "; trying the previous step." if s != steps[-1] else ".")
    raise CheckpointError(f"No checkpoint in {self.directory} could be restored: every step "
                          f"({damaged}) is damaged and was moved aside to {self.directory / 'damaged'}")

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


def restore_params(setup, job_dir: str) -> tuple[Any, int]:
  """(params, step) of the newest checkpoint in `job_dir`, laid out as `setup` (a
  `ModelSetup`, trainer/model_setup.py; its `abstract_params` say where each array goes, on
  any mesh). Only the params are read, by orbax's partial restore: eval, decode and export
  need no optimizer state (twice the params' bytes under Adam), and nothing here builds one.
  Raises FileNotFoundError naming the mode that writes one when `job_dir` holds none, and
  what `Checkpointer.restore` raises otherwise."""
  exp = setup.exp
  wanted = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=setup.replicated),
            "params": setup.abstract_params}
  with Checkpointer(os.path.join(job_dir, "checkpoints"), exp.checkpoint) as checkpointer:
    if checkpointer.latest_step() is None:
      how = "import or train first (--mode=import / --mode=train)" if exp.name.startswith("hf:") \
          else "train first (--mode=train)"
      raise FileNotFoundError(f"no checkpoint in {job_dir}/checkpoints; {how}")
    state, _ = checkpointer.restore(wanted, partial=True)
  return state["params"], int(state["step"])
