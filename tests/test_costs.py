"""Loop-aware costs: a scanned layer stack costs what its unrolled twin costs."""

import dataclasses

import pytest

from shardax import configs

pytest.importorskip("libtpu")

from shardax.perf import costs, dry_run  # noqa: E402

# FSDP with full remat on a v5e:2x2 slice: both programs gather each layer's weights in
# the forward pass and again in the recomputed backward, so they move the same bytes.
SETS = ["data.source='synthetic'", "model.num_layers=4", "model.num_heads=2", "data.seq_len=32",
        "model.max_len=32", "train.global_batch=8", "model.d_model=256", "model.d_ff=1024",
        "model.remat='full'", "sharding.preset='fsdp'", "mesh.topology='v5e:2x2'", "mesh.ici=(4,1)"]


def compiled_for(scan: bool):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, SETS + [f"model.scan_layers={scan}"])
  _, setup = dry_run.prepare(configs.build(cfg))
  return dry_run.compile_step(setup)


@pytest.fixture(scope="module")
def twins():
  scanned, unrolled = compiled_for(True), compiled_for(False)
  return costs.of_compiled(scanned), costs.of_compiled(unrolled), scanned


def test_scanned_and_unrolled_agree_within_5_percent(twins):
  scanned, unrolled, _ = twins
  for name in ("flops", "bytes_accessed", "collective_bytes"):
    a, b = getattr(scanned, name), getattr(unrolled, name)
    assert a == pytest.approx(b, rel=0.05), (name, a, b)


def test_the_layer_loops_are_found_with_their_trip_count(twins):
  scanned, unrolled, compiled = twins
  assert unrolled.loops == ()
  assert [l.trip_count for l in scanned.loops] == [4, 4]  # forward scan, backward scan
  # XLA's own figure counts each body once: far below the real work.
  assert scanned.flops_loop_bodies_once == pytest.approx(
      dry_run.report.flops(compiled), rel=1e-3)
  assert scanned.flops > 2.5 * scanned.flops_loop_bodies_once


NESTED = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_cond (p: (s32[], f32[64,64])) -> pred[] {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%inner_body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64] get-tuple-element(%p), index=1
  %d = f32[64,64] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,64]) tuple(%j, %d)
}

%outer_cond (p: (s32[], f32[64,64])) -> pred[] {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (p: (s32[], f32[64,64])) -> (s32[], f32[64,64]) {
  %p = (s32[], f32[64,64]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,64] get-tuple-element(%p), index=1
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[64,64]) tuple(%zero, %x)
  %w = (s32[], f32[64,64]) while(%t0), condition=%inner_cond, body=%inner_body
  %y = f32[64,64] get-tuple-element(%w), index=1
  %r = f32[64,64] all-reduce(%y), replica_groups={{0,1}}, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[64,64]) tuple(%j, %r)
}

ENTRY %main (x: f32[64,64]) -> f32[64,64] {
  %x = f32[64,64] parameter(0)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[64,64]) tuple(%zero, %x)
  %w = (s32[], f32[64,64]) while(%t0), condition=%outer_cond, body=%outer_body
  ROOT %y = f32[64,64] get-tuple-element(%w), index=1
}
"""


def test_nested_loops_multiply():
  c = costs.of_hlo_text(NESTED)
  dot = 2 * 64 ** 3
  assert dot * 15 <= c.flops < dot * 15 * 1.01   # 5 outer x 3 inner matmuls (+ loop counters)
  assert c.flops_loop_bodies_once < dot * 1.01
  assert c.collective_bytes == 5 * 64 * 64 * 4
  assert sorted((l.trip_count, l.executions) for l in c.loops) == [(3, 15), (5, 5)]


def test_a_loop_counting_in_steps_of_two_runs_half_as_often():
  # The TPU compiler's bidirectional windowed einsums run `i < N` with i += 2.
  hlo = NESTED.replace("constant(3)", "constant(6)").replace(  # the first is the inner body's
      "%one = s32[] constant(1)\n  %j = s32[] add(%i, %one)", "%two = s32[] constant(2)\n  %j = s32[] add(%i, %two)", 1)
  assert hlo != NESTED and "constant(6)" in hlo
  assert sorted((l.trip_count, l.executions) for l in costs.of_hlo_text(hlo).loops) == [(3, 15), (5, 5)]


def test_deepen_scales_the_layer_loops_and_what_lies_outside_them(twins):
  scanned = twins[0]
  assert costs.layer_loops(scanned, 4) == {l.body for l in scanned.loops}   # forward and backward scan
  assert all(l.stacked >= 4 for l in scanned.loops)     # they carry the stacked [4, ...] weights
  deep = costs.deepen(scanned, shallow=4, deep=12, outside_scale=3.0)
  inside = sum(p.flops * p.executions for p in scanned.pieces if p.trips)
  outside = scanned.flops - inside
  assert deep.flops == pytest.approx(outside + 3 * inside, rel=1e-6)
  entry = scanned.pieces[0]
  # the entry here is the optimizer update of the stacked weights: its HBM traffic grows with them
  assert deep.pieces[0].hbm_bytes == pytest.approx(3.0 * entry.hbm_bytes, rel=0.02) and deep.pieces[0].executions == 1
  assert sorted(p.executions for p in deep.pieces if p.trips) == sorted(
      3 * p.executions for p in scanned.pieces if p.trips)
  assert deep.collective_bytes > scanned.collective_bytes


def test_a_trip_count_equal_to_the_depth_is_not_proof_of_a_layer_loop():
  """NESTED's outer loop runs 5 times but carries no stacked weights: not the layer loop."""
  c = costs.of_hlo_text(NESTED)
  assert [l.stacked for l in sorted(c.loops, key=lambda l: l.trip_count)] == [0, 0]
  assert costs.layer_loops(c, 5) == set()
  deep = costs.deepen(c, shallow=5, deep=20, outside_scale=3.0)
  assert deep.flops == pytest.approx(c.flops) and [l.executions for l in deep.loops] == [l.executions for l in c.loops]
  # ... unless the costs predate the state check (stacked unknown): the trip count decides
  legacy = costs.Costs(c.flops, c.transcendentals, c.bytes_accessed, c.collectives,
                       tuple(dataclasses.replace(l, stacked=-1, leading=()) for l in c.loops), c.flops_loop_bodies_once,
                       tuple(dataclasses.replace(p, loops=()) for p in c.pieces), c.owner)
  assert costs.deepen(legacy, shallow=5, deep=20, outside_scale=3.0).flops == pytest.approx(4 * c.flops, rel=0.01)


def test_a_loop_unrolled_by_two_counts_both_adds():
  hlo = NESTED.replace("constant(3)", "constant(6)").replace(
      "%one = s32[] constant(1)\n  %j = s32[] add(%i, %one)",
      "%one = s32[] constant(1)\n  %h = s32[] add(%i, %one)\n  %j = s32[] add(%one, %h)", 1)
  assert sorted((l.trip_count, l.executions) for l in costs.of_hlo_text(hlo).loops) == [(3, 15), (5, 5)]


def test_bytes_are_logical_whatever_tiles_the_layouts_carry():
  # jaxlib 0.11's cost analysis rounds a dim of 64 up to the 128-wide tile it reads in the
  # layout (jaxlib 0.10's did not): the same program must cost the same on both.
  tiled = NESTED.replace("%d = f32[64,64] dot", "%d = f32[64,64]{1,0:T(8,128)S(1)} dot").replace(
      "%j = s32[] add(%i, %one)", "%j = s32[]{:S(2)} add(%i, %one)")
  assert tiled.count(":T(8,128)") == 1 and tiled.count("{:S(2)}") == 2
  assert costs.of_hlo_text(tiled).bytes_accessed == costs.of_hlo_text(NESTED).bytes_accessed


def test_a_sparsecore_computation_ends_where_its_execution_thread_is_named():
  """v6e programs close SparseCore computations with `}, execution_thread="sparsecore"`;
  read as still open, the entry after it was swallowed and the cost analysis failed with
  'computation does not exist' (the Mixtral dry run on v6e:16x16)."""
  hlo = "\n".join([
      "HloModule m", "",
      "%sc_body (p: f32[4]) -> f32[4] {", "  %p = f32[4]{0} parameter(0)",
      "  ROOT %n = f32[4]{0} negate(%p)", '}, execution_thread="sparsecore"', "",
      "ENTRY %main (a: f32[4]) -> f32[4] {", "  %a = f32[4]{0} parameter(0)",
      "  ROOT %c = f32[4]{0} call(%a), to_apply=%sc_body", "}", ""])
  mod = costs._split(hlo)
  assert sorted(mod.blocks) == ["main", "sc_body"] and mod.entry == "main"
  assert mod.callees["main"] == ["sc_body"]


# A dropless MoE step whose FLOPs are mostly its experts': 4 experts, one per chip of a
# v5p:2x2x1 slice, exchanged by ragged all-to-all into a buffer of one fair share.
MOE_SETS = ["data.source='synthetic'", "model.num_layers=1", "model.d_model=128", "model.num_heads=4",
            "data.seq_len=128", "model.max_len=128", "train.global_batch=16", "model.dtype='bfloat16'",
            "model.remat='none'", "model.moe.num_experts=4", "model.moe.d_ff=1024",
            "model.moe.expert_buffer=1.0", "model.moe.expert_overflow='drop'",
            "mesh.topology='v5p:2x2x1'", "mesh.ici=(1,4)", "mesh.axes=('data','expert')",
            "sharding.preset=None",
            "sharding.rules=(('batch',('data','expert')),('expert','expert'),('embed','data'))"]


def test_a_dropless_moe_step_is_priced_at_least_its_model_flops():
  """On TPU, ragged_dot's forward and input-gradient matmuls are Mosaic kernels
  (`tpu_custom_call` ragged-dot-*) that XLA's cost analysis prices at 0; only the weight
  gradient (a masked dense convolution) was counted, so this step priced 0.49x its model
  FLOPs and the Mixtral pod dry run showed a recompute factor of 0.82 under full remat."""
  cfg = configs.get("moe.mixtral_tiny")
  configs.apply_overrides(cfg, MOE_SETS)
  exp = configs.build(cfg)
  mesh, setup = dry_run.prepare(exp)
  c = costs.of_compiled(dry_run.compile_step(setup))
  model = float(exp.model.flops_per_example(exp.data)) * exp.train.global_batch
  kernels = [op for p in c.pieces for op in p.ops if op[0] == "gemm"]
  assert c.flops * mesh.size >= model
  assert len(kernels) == 6          # gate, up, out: forward and input gradient
  assert c.flops * mesh.size <= 1.5 * model   # a buffer of one fair share: little padding
