"""TPU topology name -> devices to build a mesh on and compile for, without the hardware.

libtpu can describe any TPU slice ("v5e:16x16", "v3:32x32", ...) on a machine that
has no TPU: `jax.experimental.topologies.get_topology_desc` returns device objects
with the real chip kind and torus coordinates. A `Mesh` over them is an ordinary
mesh, `jit(...).lower(abstract args).compile()` runs the real TPU compiler against
it, and `memory_analysis()` reports real per-device HBM use. Nothing can *run* on
these devices: they exist for ahead-of-time (AOT) dry runs.

Names are `<generation>:<chips per dim>` as on Cloud TPU: v3 and v5e/v6e are 2D tori
("v3:32x32" = 1024 chips = 2048 TPUv3 cores, each core its own jax device),
v4, v5p and TPU7x (Ironwood) are 3D ("v4:8x16x16" = 2048 chips; "tpu7x:4x4x4" = 64 chips
= 128 jax devices, its two TensorCores each their own device). v4 and v5p chips appear as one
"megacore" device each, as on a real v4/v5p VM (libtpu's default chip config for
v4 would list its two cores separately). On a CPU-only machine libtpu wants a
few environment variables it would otherwise read from the Cloud TPU metadata
server; we set neutral values (only when no TPU backend is running) so that it
prints no errors and does not take the one-process-per-host lock.
"""

from __future__ import annotations

import functools
import math
import os
import re

import jax

GENERATIONS = ("v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x")
_NAME = re.compile(r"^(v\d[a-z]*|tpu7x):(\d+(?:x\d+){1,2})$")
# A Cloud TPU accelerator type of each generation; libtpu only needs it to be valid.
_ACCELERATOR_TYPE = {"v2": "v2-8", "v3": "v3-8", "v4": "v4-8", "v5e": "v5litepod-4",
                     "v5p": "v5p-8", "v6e": "v6e-4", "tpu7x": "tpu7x-8"}

_CHIP_CONFIG = {"v4": "megacore"}


class TopologyError(ValueError):
  """An unusable `mesh.topology`; the message names the fix."""


def parse(name: str) -> tuple[str, tuple[int, ...]]:
  """"v4:8x16x16" -> ("v4", (8, 16, 16)), with a clear error for anything else."""
  m = _NAME.match(str(name).strip())
  if not m or m.group(1) not in GENERATIONS:
    raise TopologyError(f"mesh.topology={name!r}: expected GENERATION:AxB[xC] with GENERATION one of "
                        f"{', '.join(GENERATIONS)}, e.g. v5e:16x16, v3:32x32, v4:8x16x16, v5p:8x8x8, tpu7x:4x4x4")
  return m.group(1), tuple(int(s) for s in m.group(2).split("x"))


def num_chips(name: str) -> int:
  return math.prod(parse(name)[1])


def _quiet_libtpu(generation: str) -> None:
  """Environment libtpu reads when it starts; harmless (and skipped) on a real TPU host."""
  try:
    on_tpu = jax.default_backend() == "tpu"
  except RuntimeError:
    on_tpu = False
  if on_tpu:
    return
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", _ACCELERATOR_TYPE[generation])
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_WORKER_ID", "0")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # many dry runs may share a host


def available() -> bool:
  """Whether libtpu (which holds the topology descriptions) is installed."""
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None


@functools.lru_cache(maxsize=None)
def devices(name: str, num_slices: int = 1) -> tuple[jax.Device, ...]:
  """The TPU devices of topology `name` (x `num_slices` slices over DCN), for AOT compiles."""
  generation, dims = parse(name)
  if not available():
    raise TopologyError(f"mesh.topology={name!r} needs libtpu for its topology description: "
                        f"pip install 'shardax[tpu]' (libtpu==0.0.42.1)")
  _quiet_libtpu(generation)
  from jax.experimental import topologies
  # Hosts hold 2x2 chips (one chip in each dim beyond the second); any bound that
  # divides the slice works for AOT compiles since nothing runs on these hosts.
  host = tuple(min(2, d) for d in dims[:2]) + (1,)
  try:
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=name, chip_config_name=_CHIP_CONFIG.get(generation, "default"),
        chips_per_host_bounds=host, num_slices=num_slices)
  except Exception as e:  # libtpu's own message says which dims it rejects
    raise TopologyError(f"mesh.topology={name!r}: libtpu rejected it ({str(e).splitlines()[0]}); "
                        f"use a Cloud TPU slice shape such as v5e:4x4 or v4:4x4x4") from None
  return tuple(desc.devices)


def device_kind(name: str) -> str:
  """jax's device_kind of the topology's chips, e.g. "TPU v4", "TPU v5 lite"."""
  return devices(name)[0].device_kind
