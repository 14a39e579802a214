"""sharding/target.py: the platform a program compiles for, which a dry run's TPU topology
decides on this CPU host (layers pick kernels by it; the step picks its guard by it)."""

import jax
import numpy as np
import pytest

from shardax.layers import attention_choice, moe_dispatch
from shardax.layers.attention import AttentionOptions
from shardax.sharding import topology
from shardax.sharding.target import target_platform


def test_a_tpu_topology_mesh_compiles_for_tpu_on_a_cpu_host():
  pytest.importorskip("libtpu")
  mesh = jax.sharding.Mesh(np.array(topology.devices("v5e:2x2")), ("data",))
  assert jax.default_backend() == "cpu" and target_platform(mesh) == "tpu"
  with jax.set_mesh(mesh):   # what the layers see while the dry run traces
    assert target_platform() == "tpu"
    assert (moe_dispatch.resolve_impl("auto"), moe_dispatch.resolve_exchange("auto")) == ("ragged_dot", "ragged")
    assert attention_choice.resolve(AttentionOptions("auto"), 256, 256) == "flash"


def test_without_a_mesh_or_on_a_cpu_mesh_it_is_the_cpu():
  assert target_platform() == "cpu"
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  assert target_platform(mesh) == "cpu"
  with jax.set_mesh(mesh):
    assert target_platform() == "cpu" and moe_dispatch.resolve_impl("auto") == "tiled"
