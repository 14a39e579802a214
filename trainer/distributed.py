"""Starting many processes as one job: `jax.distributed` does the work.

Each host runs the same command. Processes find each other through a coordinator
(process 0's address); after `initialize`, `jax.devices()` lists every device of
the job, a mesh can span hosts, and XLA's collectives cross them. Three ways in:

- explicit: `--coordinator_address=host:port --num_processes=N --process_id=i`
  (or SHARDAX_COORDINATOR_ADDRESS / SHARDAX_NUM_PROCESSES / SHARDAX_PROCESS_ID);
- detected by jax: Cloud TPU pods, SLURM (`srun`), Open MPI (`mpirun`);
- neither: one process, nothing to do.

On CPUs, collectives between processes go through gloo.
"""

from __future__ import annotations

import os
import sys

from absl import logging

_ENV = {"coordinator_address": "SHARDAX_COORDINATOR_ADDRESS",
        "num_processes": "SHARDAX_NUM_PROCESSES", "process_id": "SHARDAX_PROCESS_ID"}


def _cluster_detected() -> bool:
  """A launcher jax knows how to read has started several processes."""
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    return True
  if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return True
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hosts.split(",") if h]) > 1


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
  """Join the job's other processes; returns True when running as several processes.

  Must run before anything touches a jax device.
  """
  coordinator_address = coordinator_address or os.environ.get(_ENV["coordinator_address"])
  if num_processes is None and _ENV["num_processes"] in os.environ:
    num_processes = int(os.environ[_ENV["num_processes"]])
  if process_id is None and _ENV["process_id"] in os.environ:
    process_id = int(os.environ[_ENV["process_id"]])
  explicit = coordinator_address is not None
  if not explicit and not _cluster_detected():
    if num_processes not in (None, 1):
      raise ValueError(f"num_processes={num_processes} needs --coordinator_address=HOST:PORT "
                       f"(process 0's address, reachable from every process)")
    return False
  if explicit and (num_processes is None or process_id is None):
    raise ValueError("--coordinator_address needs --num_processes and --process_id too "
                     "(the same coordinator and count on every process, ids 0..N-1)")
  import jax
  if os.environ.get("JAX_PLATFORMS", "") == "cpu" or _no_accelerator():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if explicit:
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id)
  else:
    jax.distributed.initialize()
  line = (f"process {jax.process_index()} of {jax.process_count()}; {jax.local_device_count()} "
          f"local devices of {jax.device_count()}")
  logging.info(line)
  print(line, file=sys.stderr, flush=True)  # a status line: shown on the quiet terminal too
  return True


def _no_accelerator() -> bool:
  import importlib.util
  return not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def is_primary() -> bool:
  """Process 0 writes the job's logs, metrics and config; every process writes checkpoints."""
  import jax
  return jax.process_index() == 0
