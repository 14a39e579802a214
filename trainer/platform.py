"""Which jax platform a run uses: decided once, before jax starts, and never hiding an accelerator.

jax picks its backend itself (TPU, then GPU, then CPU), with one bad case: with libtpu
installed (the `test` and `tpu` extras carry it, for dry runs against TPU topologies)
on a machine without a TPU, jax tries the TPU backend and prints a page of errors
before falling back. Only then do we steer it: to the GPU when a GPU is here, else
to the CPU. Everything else is left to jax, and an explicit `JAX_PLATFORMS` always wins.

`choose` is a pure function of what was found, so every case is unit-tested;
`probe` gathers those facts from this machine (files and installed packages only:
it must not start jax, which would fix the backend before we decide).

`apply` must run before jax starts a backend: importing shardax calls it before anything
imports jax, so library users get the same decision as the command line. It also sets
jax's config when jax is already loaded (a caller that imported jax first), so jax never
starts libtpu on a machine with no TPU, which would print its errors before a run's first line.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import sys

# jax's GPU plugins, by the platform name JAX_PLATFORMS uses for them.
_GPU_PLUGINS = {"cuda": ("jax_cuda13_plugin", "jax_cuda12_plugin"), "rocm": ("jax_rocm7_plugin", "jax_rocm60_plugin")}


@dataclasses.dataclass(frozen=True)
class Machine:
  """What decides the platform: installed packages, attached devices, the user's setting."""
  libtpu: bool            # libtpu importable (jax would try the TPU backend)
  tpu: bool               # a TPU is attached (device files, or a Cloud TPU VM's variables)
  gpu: str | None         # "cuda"/"rocm": that jax GPU plugin is installed and a GPU device node exists
  jax_platforms: str | None = None  # JAX_PLATFORMS as given by the user, if at all


@dataclasses.dataclass(frozen=True)
class Choice:
  """`jax_platforms`: the JAX_PLATFORMS to set (None: leave jax's own choice); `why`: for the log."""
  jax_platforms: str | None
  why: str


def choose(m: Machine) -> Choice:
  """The platform decision; the only case we intervene in is libtpu without a TPU."""
  if m.jax_platforms:
    return Choice(None, f"JAX_PLATFORMS={m.jax_platforms} given")
  if m.tpu:
    return Choice(None, "TPU attached")
  if m.libtpu and m.gpu:
    return Choice(f"{m.gpu},cpu", f"{m.gpu} GPU attached; libtpu installed but no TPU, so jax is kept off it")
  if m.libtpu:
    return Choice("cpu", "libtpu installed but no TPU or GPU attached")
  return Choice(None, f"{m.gpu} GPU attached" if m.gpu else "no accelerator found")


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


def probe(environ=os.environ) -> Machine:
  """This machine's facts, without starting jax."""
  tpu = bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")) or "TPU_NAME" in environ
  devices = {"cuda": bool(glob.glob("/dev/nvidia[0-9]*")), "rocm": os.path.exists("/dev/kfd")}
  gpu = next((kind for kind, plugins in _GPU_PLUGINS.items()
              if devices[kind] and any(_installed(p) for p in plugins)), None)
  return Machine(libtpu=_installed("libtpu"), tpu=tpu, gpu=gpu,
                 jax_platforms=environ.get("JAX_PLATFORMS") or None)


_APPLIED: list[Choice] = []   # this process's decision (importing shardax makes it; main.py reads it)


def apply(environ=os.environ) -> Choice:
  """Decide for this machine and set JAX_PLATFORMS when needed (in `environ`, for this process
  and its children, and in jax's config when jax is already imported and `environ` is this
  process's); call before jax starts a backend. For this process the first decision stands:
  a later call returns it (its JAX_PLATFORMS is ours, not the user's)."""
  if environ is os.environ and _APPLIED:
    return _APPLIED[0]
  choice = choose(probe(environ))
  if choice.jax_platforms:
    environ["JAX_PLATFORMS"] = choice.jax_platforms
    jax = sys.modules.get("jax")
    if jax is not None and environ is os.environ:
      jax.config.update("jax_platforms", choice.jax_platforms)
  if environ is os.environ:
    _APPLIED.append(choice)
  return choice


def describe(choice: Choice, joined: str | None = None) -> str:
  """The run's first log line: the platform jax started on, its device counts, and why.

  `joined`: how the processes of a multi-process job found each other (distributed.initialize).
  """
  import jax
  procs = (f"process {jax.process_index()} of {jax.process_count()} ({joined})" if joined
           else "one process")
  return (f"platform {jax.default_backend()}: {jax.device_count()} devices, "
          f"{jax.local_device_count()} local; {procs}; {choice.why}")


def is_cpu_only(environ=os.environ) -> bool:
  """Whether this run will have no accelerator: CPU collectives (gloo) are needed between hosts."""
  platforms = environ.get("JAX_PLATFORMS", "")
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  m = probe(environ)
  return not (m.tpu or m.gpu)
