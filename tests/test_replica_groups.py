"""One parser of replica groups: every form the compilers print, from real compiled HLO.

The attribute strings below were copied from programs compiled here: the TPU ones from
a 2D (data 16 x model 2) LM train step for `v4:2x4x4` (libtpu 0.0.42.1), the CPU ones
from the 8-device CPU mesh (compiled in the test itself).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.sharding import MeshConfig, make_mesh, report, topology
from shardax.perf.hlo import groups as rg
from shardax.perf import links

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")

# Copied from the v4:2x4x4 program (data=16, model=2; 32 devices).
V4_FORMS = {
    "replica_groups={{0,1},{2,3},{4,5},{6,7},{8,9},{10,11},{12,13},{14,15},{16,17},{18,19},{20,21},{22,23},"
    "{24,25},{26,27},{28,29},{30,31}}, use_global_device_ids=true": [[2 * i, 2 * i + 1] for i in range(16)],
    "replica_groups=[16,2]<=[32], dimensions={2}": [[2 * i, 2 * i + 1] for i in range(16)],
    "replica_groups=[2,16]<=[16,2]T(1,0), dimensions={1}": [list(range(0, 32, 2)), list(range(1, 32, 2))],
    # iota(32) as [8,2,2], transposed to [2,2,8], read as 4 groups of 8
    "replica_groups=[4,8]<=[8,2,2]T(2,1,0), use_global_device_ids=true":
        [[k + 4 * j for j in range(8)] for k in range(4)],
    "replica_groups=mesh['axis_0'=16,'axis_1'=1,'axis_2'=2] {'axis_2'}, dimensions={0}":
        [[2 * i, 2 * i + 1] for i in range(16)],
    "replica_groups=mesh['axis_0'=16,'axis_1'=2] {'axis_0'}, use_global_device_ids=true":
        [list(range(0, 32, 2)), list(range(1, 32, 2))],
    "replica_groups=mesh['axis_0'=1,'axis_1'=16,'axis_2'=2,'axis_3'=1] {'axis_0','axis_1','axis_2','axis_3'}, x":
        [list(range(32))],
    # the mesh's device i is entry i of iota([16,2]).T: axis_0 (2) is the minor id bit
    "replica_groups=mesh['axis_0'=2,'axis_1'=16], device_ids=([16,2]T(1,0)) {'axis_0','axis_1'}, x":
        [[j * 2 + i for i in range(2) for j in range(16)]],
    # Shardy sub-axis: axis_0 (16) cut into [2, 8]; the group runs along the 8 (the issue's crash)
    "replica_groups=mesh['axis_0'=16,'axis_1'=1,'axis_2'=2], device_ids=([2,8,2]T(2,1,0)) {'axis_0':(2)8}, "
    "dimensions={0}": [[k * 16 + 2 * j + i for j in range(8)] for i in range(2) for k in range(2)],
}


@pytest.mark.parametrize("attr", list(V4_FORMS))
def test_every_form_printed_for_a_v4_program(attr):
  groups = rg.groups(attr, 32)
  assert sorted(map(sorted, groups)) == sorted(map(sorted, V4_FORMS[attr]))
  assert rg.group_size(attr, 32, "all-reduce") == len(V4_FORMS[attr][0])
  assert rg.attribute("  %x = f32[2] all-reduce(%y), " + attr).startswith("replica_groups=")


def test_sub_axes_by_hand_and_small_forms():
  # a = 2 a_hi + a_lo; device (a, b) = 2 a + b
  assert rg.groups("replica_groups=mesh['a'=4,'b'=2] {'a':(2)2}", 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
  assert rg.groups("replica_groups=mesh['a'=4,'b'=2] {'a':(1)2}", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert rg.groups("replica_groups=mesh['a'=4,'b'=2] {'a':(1)2,'b'}", 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
  assert rg.groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert rg.groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
  assert rg.groups("no groups at all", 2) == [[0, 1]]
  assert rg.groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1], [1, 0]]
  assert rg.moving_pair("source_target_pairs={{0,0},{2,3}}") == [2, 3]
  with pytest.raises(ValueError, match="axis 'c'"):
    rg.groups("replica_groups=mesh['a'=4,'b'=2] {'c'}", 8)


def test_cpu_programs_parse_to_the_mesh_axis_they_reduce():
  """Real compiled CPU HLO on a (2, 4) mesh: a sum over `model` is 2 groups of 4 neighbours."""
  mesh = make_mesh(MeshConfig(ici=(2, 4)))
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
  for axis, spec, want in ((1, P("data"), [[0, 1, 2, 3], [4, 5, 6, 7]]),
                           (0, P("model"), [[0, 4], [1, 5], [2, 6], [3, 7]])):
    hlo = jax.jit(lambda a: a.sum(axis), out_shardings=NamedSharding(mesh, spec)).lower(x).compile().as_text()
    [c] = report.collectives(hlo)
    assert c.kind == "all-reduce" and c.group_size == len(want[0])
    assert sorted(rg.groups(c.replica_groups, 8)) == want
    assert links.first_group(c.replica_groups, 8) == want[0]


@needs_libtpu
@pytest.mark.slow
def test_the_issue_v4_2d_program_with_sub_axes_reports(tmp_path):
  """The issue's v4 2D dry run, shrunk (1 layer, narrow) but keeping the embedding gather whose
  all-to-all the compiler writes with a Shardy sub-axis; it crashed in report._group_size."""
  from shardax import configs
  from shardax.perf import dry_run
  cfg = configs.get("lm.small")
  configs.apply_overrides(cfg, [
      "mesh.topology='v4:2x4x4'", "mesh.ici=(16,2)", "mesh.axes=('data','model')", "sharding.preset='2d'",
      "model.num_layers=1", "model.d_model=256", "model.num_heads=2", "model.head_dim=128", "model.d_ff=512",
      "model.mlp='plain'", "model.activation='gelu'", "model.vocab_size=32000", "model.max_len=128",
      "data.seq_len=128", "data.source='synthetic'", "train.global_batch=512", "model.dtype='bfloat16'"])
  r = dry_run.dry_run(configs.build(cfg), str(tmp_path))
  assert r["error"] is None and r["predicted"]["step_seconds"] > 0
  assert r["collectives"]["all-to-all"]["count"] >= 1
  assert "predicted step" in dry_run.format_report(r)
