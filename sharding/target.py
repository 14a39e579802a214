"""The platform the program being built will compile for: the one platform check.

Not always the platform this process runs on: a dry run compiles for a TPU topology
(sharding/topology.py) on a CPU host, so its mesh's devices say 'tpu' while
`jax.default_backend()` says 'cpu'. Layers ask while tracing (the mesh in force); the
trainer asks with the mesh it compiles the step for.
"""

from __future__ import annotations

import jax


def target_platform(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None) -> str:
  """'cpu', 'gpu' or 'tpu': the devices of `mesh`, else of the mesh in force
  (`jax.set_mesh`), else jax's default backend."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  mesh = getattr(mesh, "abstract_mesh", mesh)   # a concrete Mesh: its devices' abstract form
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  return getattr(device, "platform", None) or jax.default_backend()
