"""jax's persistent compilation cache, on by default: a restart, a resumed job or a second
dry run of the same program reads XLA's executable back instead of compiling it again.

`train.compilation_cache_dir`:
  None (default)  $JAX_COMPILATION_CACHE_DIR when set (`make test` sets one), else the
                  user's cache dir: $XDG_CACHE_HOME/shardax/jax_cache (~/.cache/... without it)
  'job_dir'       <job_dir>/jax_cache (travels with the job; on gs:// it is read remotely)
  ''              off
  any other path  that directory

Threshold: programs that compiled in under MIN_COMPILE_S = 0.25 s are not written (jax's
default is 1 s). A restart compiles the train step (1.5 s for a 2-layer model on a CPU, 20 s
for lm.1b on a GPU, minutes for int8/fp8), the eval step and the state init once each; on a
mid-sized model the init and eval programs take 0.3-1 s each, so jax's 1 s would recompile
them on every restart. Below 0.25 s are the many small eager ops and helpers: each entry
costs a file (on a shared or remote cache dir, a round trip per lookup and per write), more
than recompiling it. An explicit JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS still wins.

Hits are logged ("compilation cache hit: ... s of compile saved") through jax.monitoring's
events, and counted for the run's goodput record (trainer/goodput.py).
"""

from __future__ import annotations

import os
import threading

from absl import logging

MIN_COMPILE_S = 0.25
_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
# jax's own compile phases (jax/_src/dispatch.py): trace, lowering, backend compile (or cache read)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class _Counters:
  """Cache hits and the compile seconds they saved; compile seconds spent (this process)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.hits = 0
    self.saved_s = 0.0
    self.compile_s = 0.0
    self.listening = False


COUNTERS = _Counters()


def resolve(setting: str | None, job_dir: str, environ=os.environ) -> str | None:
  """The cache directory `setting` names (None: the cache is off)."""
  if setting == "":
    return None
  if setting == "job_dir":
    return os.path.join(job_dir, "jax_cache")
  if setting is not None:
    return os.path.expanduser(setting)
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return environ["JAX_COMPILATION_CACHE_DIR"]
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "shardax", "jax_cache")


def enable(setting: str | None, job_dir: str) -> str | None:
  """Points jax at the cache (before the first compile) and starts logging hits; returns the
  directory, or None when off."""
  import jax
  listen()
  directory = resolve(setting, job_dir)
  if directory is None:
    jax.config.update("jax_enable_compilation_cache", False)
    logging.info("compilation cache: off")
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", directory)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
  logging.info("compilation cache: %s (programs compiling in >= %ss are kept)", directory,
               jax.config.jax_persistent_cache_min_compile_time_secs)
  return directory


def _on_event(event: str, **kwargs) -> None:
  if event == _HIT:
    with COUNTERS.lock:
      COUNTERS.hits += 1


def _on_duration(event: str, seconds: float, **kwargs) -> None:
  if event == _SAVED:
    with COUNTERS.lock:
      COUNTERS.saved_s += max(seconds, 0.0)
    logging.info("compilation cache hit: %.2fs of compile saved", seconds)
  elif event in COMPILE_EVENTS:
    with COUNTERS.lock:
      COUNTERS.compile_s += seconds


def listen() -> None:
  """Registers the jax.monitoring listeners once per process."""
  from jax import monitoring
  if COUNTERS.listening:
    return
  COUNTERS.listening = True
  monitoring.register_event_listener(_on_event)
  monitoring.register_event_duration_secs_listener(_on_duration)


def compile_seconds() -> float:
  """Seconds this process has spent tracing, lowering and compiling (or reading the cache)."""
  with COUNTERS.lock:
    return COUNTERS.compile_s


def summary() -> str:
  with COUNTERS.lock:
    return f"{COUNTERS.hits} compilation cache hits saved {COUNTERS.saved_s:.1f}s of compile"
