"""mesh_split / shard semantics, logical rules, mesh building and the HLO report parser."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.sharding import MeshConfig, make_mesh, mesh_split, shard, use_rules
from shardax.sharding import report, rules as rules_lib


@pytest.fixture(scope="module")
def mesh24():
  return make_mesh(MeshConfig(ici=(2, 4), axes=("data", "model")))


def test_mesh_split_gives_expected_named_sharding(mesh24):
  x = jnp.arange(64.0).reshape(8, 8)
  with jax.set_mesh(mesh24):
    y = jax.jit(lambda a: mesh_split(a * 1, ("data", "model")))(x)
    z = jax.jit(lambda a: mesh_split(a * 1, (None, ("data", "model"))))(x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh24, P("data", "model")), 2)
  assert z.sharding.is_equivalent_to(NamedSharding(mesh24, P(None, ("data", "model"))), 2)
  assert (y == x).all() and (z == x).all()


def test_mesh_split_is_noop_without_mesh_or_on_one_device():
  x = jnp.ones((4, 4))
  assert mesh_split(x, ("data", None)) is x
  one = make_mesh(MeshConfig(ici=(1,), axes=("data",)), devices=jax.devices()[:1])
  with jax.set_mesh(one):
    assert mesh_split(x, ("data", None)) is x


@pytest.mark.parametrize("mapping, match", [
    (("data",), "one entry per dim"),
    (("data", "nope"), "unknown mesh axis 'nope'"),
    (("data", "data"), "'data' is used by more than one dim"),
    ((("data", "model"), "model"), "'model' is used by more than one dim"),
])
def test_mesh_split_errors_name_shape_and_mapping(mesh24, mapping, match):
  with jax.set_mesh(mesh24), pytest.raises(ValueError, match=match) as err:
    mesh_split(jnp.ones((8, 8)), mapping)
  assert "(8, 8)" in str(err.value)


def test_rule_order_gives_2d_recipe():
  rules = rules_lib.PRESETS["2d"]
  mesh_shape = {"data": 2, "model": 4}
  # Weights [data, model]; activations [data, None, model] (GSPMD paper, 2D sharding).
  assert rules_lib.logical_to_spec(("embed", "mlp"), rules, mesh_shape) == P("data", "model")
  assert rules_lib.logical_to_spec(("batch", "length", "embed"), rules, mesh_shape) == P("data", None, "model")
  assert rules_lib.logical_to_spec(("batch", "length", "mlp"), rules, mesh_shape) == P("data", None, "model")
  assert rules_lib.logical_to_spec(("layers", "heads", "kv", "embed"), rules, mesh_shape) == P(None, "model", None, "data")


def test_rules_errors():
  with pytest.raises(ValueError, match=r"dim 1 \('mlp'\) has size 6.*total size 4"):
    rules_lib.logical_to_spec(("embed", "mlp"), rules_lib.PRESETS["tp"], {"data": 2, "model": 4}, (8, 6),
                              name="param w")
  assert rules_lib.logical_to_spec(("embed", "mlp"), rules_lib.PRESETS["tp"], {"data": 2, "model": 4}, (8, 6),
                                   allow_uneven=True) == P(None, "model")
  with pytest.raises(ValueError, match="names mesh axis 'model'.*has axes \\('data',\\)"):
    rules_lib.logical_to_spec(("mlp",), rules_lib.PRESETS["tp"], {"data": 8})
  with pytest.raises(ValueError, match="unknown sharding preset 'fdsp'"):
    rules_lib.resolve("fdsp")


def test_shard_uses_rules_in_force(mesh24):
  x = jnp.ones((8, 4, 8))
  with jax.set_mesh(mesh24):
    assert shard(x, ("batch", "length", "embed")) is x  # no rules in force: no-op
    with use_rules(rules_lib.PRESETS["2d"]):
      y = jax.jit(lambda a: shard(a * 2, ("batch", "length", "embed")))(x)
  assert y.sharding.is_equivalent_to(NamedSharding(mesh24, P("data", None, "model")), 3)


def test_mesh_config_fill_and_errors():
  assert dict(make_mesh(MeshConfig(ici=(-1, 2))).shape) == {"data": 4, "model": 2}
  with pytest.raises(ValueError, match=r"mesh \(2, 4\) needs 8 devices, 6 are available"):
    make_mesh(MeshConfig(ici=(2, 4)), devices=jax.devices()[:6])
  with pytest.raises(ValueError, match="one size per axis"):
    MeshConfig(ici=(2, 2, 2), axes=("data", "model"))
  with pytest.raises(ValueError, match="at most one -1"):
    MeshConfig(ici=(-1, -1))


def test_collective_parser_on_a_real_compiled_program(mesh24):
  w_sh = NamedSharding(mesh24, P(None, "model"))
  x_sh = NamedSharding(mesh24, P("data", None))

  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)

  w = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=w_sh)
  x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=x_sh)
  compiled = jax.jit(jax.grad(loss), out_shardings=w_sh).lower(w, x).compile()
  summary = report.collective_summary(compiled.as_text())
  # grad wrt w is split on model and needs a sum over the data axis: an all-reduce of
  # the per-device gradient block (64 x 32 floats).
  assert summary["all-reduce"]["count"] >= 1
  assert summary["all-reduce"]["bytes"] >= 64 * 32 * 4
  mem = report.memory(compiled)
  assert mem["argument_bytes"] == (64 * 128 // 4 + 16 * 64 // 2) * 4


def test_parser_handles_async_and_tuple_forms():
  hlo = """
  %ag = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %p), replica_groups=[2,4]<=[8], dimensions={0}
  %ar = (f32[10]{0}, bf16[6]{0}) all-reduce(f32[10]{0} %a, bf16[6]{0} %b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %rs = f32[2,8]{1,0} reduce-scatter(f32[8,8]{1,0} %g), replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(f)/x" source_file="m.py" source_line=7}
  %d = f32[16,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[16,8]{1,0}) %ag)
  """
  cs = {c.kind: c for c in report.collectives(hlo)}
  assert cs["all-gather"].bytes == 16 * 8 * 4 and cs["all-gather"].group_size == 4
  assert cs["all-reduce"].bytes == 52 and cs["all-reduce"].group_size == 2
  assert cs["reduce-scatter"].bytes == 256 and cs["reduce-scatter"].source == "m.py:7"
  assert len(report.collectives(hlo)) == 3


def test_collective_source_walks_past_library_frames_to_the_callers_line(mesh24):
  """An all-reduce made inside optax (site-packages) is named by the line that called it:
  compiled HLO prints parent_frame_id as the parent's id + 1, and a walk that took it as
  the id stopped at the optax frame (perf/hlo/sources.py stack_frames)."""
  import inspect
  import optax

  def norm(x):
    return optax.global_norm(x)   # the line the collective's source names
  line = inspect.getsourcelines(norm)[1] + 1
  x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh24, P("data", "model")))
  found = [c for c in report.collectives(jax.jit(norm).lower(x).compile().as_text())
           if c.kind == "all-reduce"]
  assert found and all(c.source.split()[0] == f"tests/test_sharding.py:{line}" for c in found), \
      [c.source for c in found]


def test_collectives_after_a_sparsecore_computation_keep_their_loop_counts():
  """v6e programs close SparseCore computations with `}, execution_thread="sparsecore"`
  (perf/hlo/module.py); read as still open, the loop and the entry after one were taken
  into it and the all-reduce ran once instead of 4 times per step."""
  hlo = "\n".join([
      "HloModule m, num_partitions=8", "",
      "%sc_body (p: f32[4]) -> f32[4] {", "  %p = f32[4]{0} parameter(0)",
      "  ROOT %n = f32[4]{0} negate(%p)", '}, execution_thread="sparsecore"', "",
      "%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {", "  %b = (s32[], f32[8]{0}) parameter(0)",
      "  %x = f32[8]{0} get-tuple-element(%b), index=1",
      "  %r = f32[8]{0} all-reduce(%x), replica_groups=[1,8]<=[8], to_apply=%add",
      "  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %r)", "}", "",
      "%cond (c: (s32[], f32[8])) -> pred[] {", "  %c = (s32[], f32[8]{0}) parameter(0)",
      "  ROOT %lt = pred[] constant(true)", "}", "",
      "ENTRY %main (a: f32[8]) -> f32[8] {", "  %a = f32[8]{0} parameter(0)",
      '  %w = (s32[], f32[8]{0}) while(%s), condition=%cond, body=%body, '
      'backend_config={"known_trip_count":{"n":"4"}}',
      "  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1", "}", ""])
  (c,) = report.collectives(hlo)
  assert (c.kind, c.computation, c.executions, c.bytes) == ("all-reduce", "body", 4, 32)
  assert report.trip_counts(hlo) == {"body": 4}
