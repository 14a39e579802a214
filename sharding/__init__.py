"""The one place that knows about meshes and shardings."""

from shardax.sharding.annotate import mesh_split, shard
from shardax.sharding.mesh import MeshConfig, make_mesh
from shardax.sharding.rules import PRESETS, logical_to_spec, use_rules

__all__ = ["MeshConfig", "PRESETS", "logical_to_spec", "make_mesh", "mesh_split", "shard", "use_rules"]
