"""The one HLO reader (perf/hlo/): records pinned on programs compiled here, on the 8-device CPU
mesh and, through libtpu's topology descriptions, for TPU slices."""

import jax
import jax.numpy as jnp
import ml_dtypes
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.perf import hlo
from shardax.perf.hlo import dtypes, matmuls, sources
from shardax.sharding import MeshConfig, make_mesh, topology

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")


def _compile(fn, *args, **jit):
  return jax.jit(fn, **jit).lower(*args).compile().as_text()


def _by_opcode(module, opcode):
  return [i for i in module if i.opcode == opcode]


def test_every_xla_primitive_type_has_a_size():
  from jax._src.lib import xla_client as xc
  names = {n.lower() for n in dir(xc.PrimitiveType) if n.isupper()} - {"tuple", "opaque_type", "primitive_type_invalid"}
  assert names <= set(dtypes.BYTES), names - set(dtypes.BYTES)
  for name in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3", "float8_e4m3fn", "bfloat16", "int4"):
    hlo_name = {"bfloat16": "bf16", "int4": "s4"}.get(name, name.replace("float8_", "f8"))
    assert dtypes.BYTES[hlo_name] == max(1, jnp.dtype(getattr(ml_dtypes, name)).itemsize), name
  assert dtypes.nbytes("f8e4m3fnuz", (4, 8)) == 32 and dtypes.nbytes("c128", (2,)) == 32
  with pytest.raises(ValueError, match="f9e9.*perf/hlo/dtypes.BYTES"):
    dtypes.nbytes("f9e9", (1,))


def test_a_sharded_matmul_all_reduce_on_the_cpu_mesh():
  mesh = make_mesh(MeshConfig(ici=(2, 4)))
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
  w = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
  m = hlo.parse(_compile(lambda a, b: a @ b, x, w, out_shardings=NamedSharding(mesh, P("data", None))))
  assert m.num_partitions == 8 and m.entry in m.computations
  [ar] = _by_opcode(m, "all-reduce")
  assert ar.results == (hlo.Array("f32", (4, 32)),) and ar.result_bytes == 4 * 32 * 4
  [dot] = [m.instructions[o] for o in ar.operands]   # its operand is the local partial product
  assert dot.opcode in ("dot", "fusion") and dot.results == ar.results
  [reducer] = ar.called   # to_apply=: a computation of the module that adds
  assert m.computations[reducer].root.opcode == "add"
  assert sorted(ar.device_groups(8)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert ar.replica_groups.startswith("replica_groups=")
  params = _by_opcode(m, "parameter")
  assert {p.results[0].dims for p in params if p.computation == m.entry} == {(4, 4), (4, 32)}


def test_a_scan_loop_names_its_condition_and_body():
  def f(x):
    return jax.lax.scan(lambda c, _: (jnp.sin(c) * 2, None), x, None, length=5)[0]
  m = hlo.parse(_compile(f, jnp.ones((4, 8), jnp.float32)))
  [loop] = _by_opcode(m, "while")
  cond, body = loop.attr("condition").lstrip("%"), loop.attr("body").lstrip("%")
  assert set(loop.called) == {cond, body} and {cond, body} <= set(m.computations)
  assert m.computations[cond].root.results == (hlo.Array("pred", ()),)
  assert loop.is_tuple and hlo.Array("f32", (4, 8)) in loop.results
  assert '"known_trip_count":{"n":"5"}' in loop.attr("backend_config")   # kept as written


def test_a_scan_over_stacked_weights_reads_its_trip_count_and_state():
  def f(x, ws):
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
  text = _compile(f, jnp.ones((4, 8), jnp.float32), jnp.ones((5, 8, 8), jnp.float32))
  [w] = hlo.whiles(hlo.parse(text))
  assert (w.trip_count, w.stacked(5)) == (5, 1) and {w.condition, w.body} == set(w.instruction.called)
  assert hlo.trip_counts(hlo.parse(text)) == {w.body: 5}
  # The compiler's known_trip_count (backend_config JSON) is what counts when written (the
  # `i < N` fallback is pinned by tests/test_costs.py's hand-written loops).
  assert hlo.whiles(hlo.parse(text.replace('"known_trip_count":{"n":"5"}', '"known_trip_count":{"n":"7"}')))[0].trip_count == 7


def test_a_convolution_counts_its_real_taps_as_xla_does():
  """A 3x3 "SAME" convolution of [2, 8, 8, 4] into 6 features, counted by hand: per spatial
  dim 8 outputs x 3 taps less the 2 that read padding at the edges = 22 (output, tap)
  pairs; 2 x batch 2 x 6 out x 4 in x 22 x 22 = 46464 FLOPs (window size x positions would
  say 55296; rows x in x out, 6144). XLA's cost analysis says the same."""
  conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  compiled = jax.jit(conv).lower(jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))).compile()
  [mm] = matmuls.matmuls(hlo.parse(compiled.as_text()))
  assert mm.instruction.opcode == "convolution" and mm.result == hlo.Array("f32", (2, 8, 8, 6))
  assert mm.flops == 2 * 2 * 6 * 4 * 22 * 22 == compiled.cost_analysis()["flops"]
  assert mm.mnk == (2 * 8 * 8, 4, 6)   # a padded window adds no depth to the matrix unit's K


def test_a_dot_counts_result_times_contraction():
  x, w = jnp.ones((3, 16, 32), jnp.float32), jnp.ones((3, 32, 8), jnp.float32)
  [mm] = matmuls.matmuls(hlo.parse(_compile(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), x, w)))
  assert (mm.dtype, mm.flops, mm.mnk) == ("f32", 2 * 3 * 16 * 8 * 32, (16, 32, 8))


def test_an_instructions_source_from_its_metadata():
  """Older jax writes source_file/source_line; the op_name's escaped quotes are undone."""
  m = hlo.parse('%a = f32[2]{0} add(%x, %y), metadata={op_name="jit(f)/it' + "\\'" + 's{x}" '
                'source_file="/src/shardax/layers/mlp.py" source_line=12}\n%b = f32[2]{0} negate(%a)')
  read = sources.Sources(m)
  assert read(m.instructions["a"]) == ("jit(f)/it's{x}", "layers/mlp.py:12")
  assert read(m.instructions["b"]) == ("", "") and read(None) == ("", "")


def test_a_collective_permute_on_the_cpu_mesh():
  mesh = make_mesh(MeshConfig(ici=(8,), axes=("x",)))
  shift = jax.shard_map(lambda a: jax.lax.ppermute(a, "x", [(i, (i + 1) % 8) for i in range(8)]),
                        mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  m = hlo.parse(_compile(shift, jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("x")))))
  [cp] = [i for i in m if m.wrapped_opcode(i) == "collective-permute" and not i.opcode.endswith("-done")]
  assert cp.replica_groups.startswith("source_target_pairs=")
  assert sorted(map(tuple, cp.device_groups(8))) == [(i, (i + 1) % 8) for i in range(8)]
  assert cp.results == (hlo.Array("f32", (2, 4)),)


def test_tuple_shapes_layouts_and_attributes_as_written():
  line = ('  %ag = (bf16[8,128]{1,0:T(8,128)(2,1)}, bf16[64,128]{1,0:T(8,128)(2,1)}) all-gather-start('
          'bf16[8,128]{1,0} %p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, '
          'metadata={op_name="jit(f)/a, b {c}" stack_frame_id=4}, backend_config={"x":{"y":1}}')
  i = hlo.module.instruction(line, "entry")
  assert (i.name, i.opcode, i.operands, i.computation) == ("ag", "all-gather-start", ("p",), "entry")
  assert i.results == (hlo.Array("bf16", (8, 128)), hlo.Array("bf16", (64, 128)))
  assert i.inline_operand_arrays == (hlo.Array("bf16", (8, 128)),)
  assert i.attr("metadata") == '{op_name="jit(f)/a, b {c}" stack_frame_id=4}'
  assert i.attr("backend_config") == '{"x":{"y":1}}' and i.attr("dimensions") == "{0}"
  assert i.device_groups(8) == [list(range(8))]


@needs_libtpu
def test_a_tpu_program_async_pairs_fusions_and_loops():
  """A scanned 2D-sharded matmul stack compiled for v5e:2x4: the TPU compiler's async
  collectives pair up, fusions name their computations, the loop its condition and body."""
  mesh = make_mesh(MeshConfig(ici=(2, 4), topology="v5e:2x4"), devices=topology.devices("v5e:2x4"))
  x = jax.ShapeDtypeStruct((64, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "model")))
  w = jax.ShapeDtypeStruct((4, 512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model", None)))

  def f(x, w):
    def layer(h, wl):
      return jax.lax.with_sharding_constraint(jnp.tanh(h @ wl), NamedSharding(mesh, P("data", "model"))), None
    return jax.lax.scan(layer, x, w)[0].sum()
  m = hlo.parse(_compile(jax.grad(f, argnums=1), x, w))
  assert m.num_partitions == 8
  for start, done in m.async_done.items():   # every -done closes a -start of the same computation
    s, d = m.instructions[start], m.instructions[done]
    assert s.opcode.endswith("-start") and d.opcode.endswith("-done") and s.computation == d.computation
  fusions = _by_opcode(m, "fusion")
  assert fusions and all(f.called and f.called[0] in m.computations for f in fusions)
  assert all(f.attr("kind").startswith("k") for f in fusions)
  [loop, *_] = _by_opcode(m, "while")
  assert set(loop.called) <= set(m.computations) and len(loop.called) == 2
  colls = [i for i in m if m.wrapped_opcode(i) in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
           and not i.opcode.endswith("-done")]
  assert colls and all(sum(map(len, c.device_groups(8))) == 8 for c in colls)
  assert all(a.nbytes > 0 for c in colls for a in c.results if a.dtype != "u32")


def f8_all_gather(dtype, topo="v5e:2x4"):
  """The text of an all-gather of a [1024, 128] `dtype` array over 8 TPU devices (the CPU
  compiler widens 8-bit floats to f16 before a collective; the TPU compiler keeps them)."""
  mesh = make_mesh(MeshConfig(ici=(8,), axes=("x",), topology=topo), devices=topology.devices(topo))
  gather = jax.shard_map(lambda a: jax.lax.all_gather(a, "x", tiled=True), mesh=mesh,
                         in_specs=P("x"), out_specs=P(None), check_vma=False)
  return _compile(gather, jax.ShapeDtypeStruct((1024, 128), dtype, sharding=NamedSharding(mesh, P("x"))))


@needs_libtpu
@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3"])
def test_an_f8_all_gather_on_tpu(dtype):
  m = hlo.parse(f8_all_gather(getattr(jnp, dtype)))
  [ag] = _by_opcode(m, "all-gather")
  assert ag.results == (hlo.Array(dtype.replace("float8_", "f8"), (1024, 128)),)
  assert ag.result_bytes == 1024 * 128


@needs_libtpu
@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3"])
def test_the_report_counts_the_bytes_of_an_f8_collective(dtype):
  """The report's collective bytes use the one dtype table: these three f8 types counted 0."""
  from shardax.sharding import report
  [c] = report.collectives(f8_all_gather(getattr(jnp, dtype)))
  assert (c.kind, c.bytes, c.group_size) == ("all-gather", 1024 * 128, 8)
  assert report.collective_summary(f8_all_gather(getattr(jnp, dtype)))["all-gather"]["bytes"] == 1024 * 128
