"""Starting many processes as one job: `jax.distributed` does the work.

Each host runs the same command. Processes find each other through a coordinator
(process 0's address); after `initialize`, `jax.devices()` lists every device of
the job, a mesh can span hosts, and XLA's collectives cross them. Ways in, first wins:

- explicit: `--coordinator_address=host:port --num_processes=N --process_id=i`
  (or SHARDAX_COORDINATOR_ADDRESS / SHARDAX_NUM_PROCESSES / SHARDAX_PROCESS_ID);
- detected by jax itself (`jax.distributed.initialize()` with no arguments): Cloud TPU
  VMs through their metadata server (pods, multi-slice), GKE TPU jobs, SLURM (`srun`),
  Open MPI (`mpirun`), and the other launchers jax knows. We ask the same detection
  jax would use whether it sees a job of several processes, and start only then;
- neither: one process, nothing to do.

A launch fails loudly rather than run wrong: a launcher that is present but whose
detection raises stops the process (`--single_process` runs it alone on purpose),
since N processes each training alone would write into one job dir; and once joined,
every process must hold the same config (a hash compared by all-gather, `agree_at_start`).
The same gather collects each process's node id (sharding/mesh.py NODE_ID_VARS), so a
host with several processes (one per GPU) is one DCN granule.

A process whose peers die must not hang: the coordination service's heartbeat
(`--heartbeat_timeout_s`, SHARDAX_HEARTBEAT_TIMEOUT_S) ends it with a non-zero status
once a peer has been silent that long; the restart resumes from the last complete
checkpoint. On CPUs, collectives between processes go through gloo; on GPUs and TPUs
XLA uses the accelerator's own (NCCL, ICI/DCN), so gloo is chosen only for CPU runs.
"""

from __future__ import annotations

import hashlib
import os

from absl import logging


class LaunchError(RuntimeError):
  """The job cannot start as the launcher or the config says (a one-line reason)."""

_ENV = {"coordinator_address": "SHARDAX_COORDINATOR_ADDRESS",
        "num_processes": "SHARDAX_NUM_PROCESSES", "process_id": "SHARDAX_PROCESS_ID",
        "heartbeat_timeout_s": "SHARDAX_HEARTBEAT_TIMEOUT_S"}
DEFAULT_HEARTBEAT_TIMEOUT_S = 100  # jax's own default


def detected_cluster(single_process: bool = False) -> tuple[str, int] | None:
  """(launcher name, process count) when jax's cluster detection sees a job of several processes.

  Uses jax's own registry of launchers (jax._src.clusters: the list
  `jax.distributed.initialize()` walks), so whatever jax can start, we start. A launcher
  whose detection raises is a LaunchError unless `single_process`.
  """
  try:
    from jax._src import clusters
  except ImportError:  # a jax that moved it: fall back to asking jax to start, as below
    return None
  for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001 - jax's detection list
    if getattr(env, "opt_in_only_method", False):
      continue
    try:
      if not env.is_env_present():
        continue
      count = int(env.get_process_count())
    except Exception as e:  # noqa: BLE001 - a half-configured launcher
      if not single_process:
        raise LaunchError(f"cluster detection {env.__name__} failed ({type(e).__name__}: {e}); "
                          f"fix the launcher's environment, or pass --single_process to run this "
                          f"process alone") from e
      logging.warning("cluster detection %s failed (%s); --single_process: running as one process",
                      env.__name__, e)
      continue
    if count > 1:
      return env.__name__, count
  return None


def _from_env(value, key: str, cast=str):
  if value is None and os.environ.get(_ENV[key]):
    return cast(os.environ[_ENV[key]])
  return value


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int | None = None,
               single_process: bool = False) -> str | None:
  """Join the job's other processes; returns how they were found (None: one process).

  Must run before anything touches a jax device. `single_process` skips detection.
  """
  coordinator_address = _from_env(coordinator_address, "coordinator_address")
  num_processes = _from_env(num_processes, "num_processes", int)
  process_id = _from_env(process_id, "process_id", int)
  heartbeat = _from_env(heartbeat_timeout_s, "heartbeat_timeout_s", int) or DEFAULT_HEARTBEAT_TIMEOUT_S
  explicit = coordinator_address is not None
  if single_process and explicit:
    raise ValueError("--single_process contradicts --coordinator_address; give one of them")
  cluster = None if explicit or single_process else detected_cluster()
  if not explicit and cluster is None:
    if num_processes not in (None, 1):
      raise ValueError(f"num_processes={num_processes} needs --coordinator_address=HOST:PORT "
                       f"(process 0's address, reachable from every process)")
    return None
  if explicit and (num_processes is None or process_id is None):
    raise ValueError("--coordinator_address needs --num_processes and --process_id too "
                     "(the same coordinator and count on every process, ids 0..N-1)")
  if heartbeat < 1:
    raise ValueError(f"--heartbeat_timeout_s={heartbeat} must be >= 1 second")
  import jax
  from shardax.trainer import platform
  if platform.is_cpu_only():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # Explicit values win; what is left unset, jax fills from the detected launcher.
  jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id,
                             heartbeat_timeout_seconds=heartbeat)
  how = "explicit coordinator" if explicit else f"{cluster[0]} detected by jax"
  return f"{how}, peers silent {heartbeat}s end the job"


def agree_at_start(config_text: str) -> None:
  """All processes hold the same config (else LaunchError naming each one's hash); also
  shares the node ids, so hosts with several processes are one granule each."""
  import jax
  from shardax.sharding import mesh as mesh_lib
  if jax.process_count() == 1:
    mesh_lib.set_node_ids(None)
    return
  raw = hashlib.sha256(config_text.encode()).digest()
  digest = [int.from_bytes(raw[k:k + 4], "big") >> 1 for k in (0, 4)]   # int32-safe (x64 is off)
  node = mesh_lib.node_id()
  rows = allgather([*digest, -1 if node is None else node])
  hashes = [f"{int(a):08x}{int(b):08x}" for a, b in rows[:, :2]]
  if len(set(hashes)) > 1:
    raise LaunchError("the processes hold different configs (hash of the resolved config): " +
                      ", ".join(f"process {i}: {h}" for i, h in enumerate(hashes)) +
                      "; start every process with the same --exp and --set flags (and the same code)")
  hosts = mesh_lib.set_node_ids([None if n < 0 else int(n) for n in rows[:, 2]])
  if hosts and jax.process_index() == 0:
    import sys
    logging.info(line := f"processes by host (from node ids): {hosts}")
    print(line, file=sys.stderr, flush=True)


def is_primary() -> bool:
  """Process 0 writes the job's logs, metrics and config; every process writes checkpoints."""
  import jax
  return jax.process_index() == 0


def allgather(values):
  """[process, len(values)]: every process's small integers (a tiny all-gather; one process:
  its own, as one row). int32: x64 is off, so wider values would be cut anyway."""
  import jax
  import numpy as np
  if jax.process_count() == 1:
    return np.asarray([values], np.int32)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int32)))


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process of the job."""
  return bool(allgather([int(bool(flag))]).any())


def lease(job_dir):
  """The job dir's lease for this job (trainer/jobdir.py Lease): process 0 takes it, all refuse with it."""
  from shardax.trainer import jobdir
  return jobdir.Lease(job_dir, primary=is_primary(), any_process=any_process)
