"""The dropless MoE's `ragged_all_to_all` exchange (the TPU and GPU default) as a TPU compiles it.

XLA:CPU cannot run ragged-all-to-all ("HLO opcode `ragged-all-to-all` is not supported by
XLA:CPU"), so its arithmetic (offsets, sizes, the way back) is checked on CPU with the
collective emulated (tests/test_moe_dropless.py: test_ragged_exchange_equals_one_device,
equal to one device as the padded exchange is). Here the real op: the train step of the
tiny dropless MoE LM compiled by libtpu for a v5e:2x2 slice (4 chips, no TPU needed,
preset `expert`: 8 experts 4-way) must move its token copies by ragged-all-to-all into a
receive buffer of the no-overflow size, and send the results back into the T x k rows.
"""

import re

import jax

import pytest

pytest.importorskip("libtpu")

from shardax.sharding import report  # noqa: E402
from shardax.perf import dry_run  # noqa: E402
from test_moe_dropless import tiny_dropless  # noqa: E402


def test_tpu_step_moves_tokens_by_ragged_all_to_all_into_the_no_overflow_buffer():
  """Per device T = 8 x 16 / 4 = 32 tokens, k = 2, so T x k = 64 rows go out. The default
  buffer holds what 4 senders can send one shard at most: 4 x 32 x min(k=2, 8/4) = 256 rows
  (expert_buffer=2.0 would give 2 x 64 = 128, seen there). Forward and backward: rows
  (f32) and their expert ids (s32) out into 256 rows, results back into 64."""
  exp = tiny_dropless("expert", (4,), ("data",), "mesh.topology='v5e:2x2'",
                      "model.moe.expert_buffer=None")
  _, setup = dry_run.prepare(exp)
  assert setup.mesh.devices.flat[0].platform == "tpu"
  hlo = dry_run.compile_step(setup).as_text()
  ops = re.findall(r"= (\w+)\[(\d+),[^\]]*\]\S* ragged-all-to-all\(", hlo)
  assert {(dt, int(rows)) for dt, rows in ops} == {("f32", 256), ("s32", 256), ("f32", 64)}, ops


def test_tpu_fsdp_step_reduce_scatters_the_expert_weight_gradients():
  """moe.mixtral_8x7b's layout (no expert parallelism, expert weights FSDP-split over every
  chip) on a v5e:2x2: the expert weights' gradients leave the backward by reduce-scatter, and
  no all-reduce carries an expert weight. Before (2026-11-26), the weights entered the
  dispatch's shard_map whole, and the backward all-reduced the three expert weights' full
  gradients (f32[8,32,32] here). Not checked here: on 16 and 128 v5p chips the TPU compiler
  itself lowers these reduce-scatters (and the dense layers') to all-reduces
  (docs/results/moe_pods.md)."""
  exp = tiny_dropless("fsdp", (4,), ("data",), "mesh.topology='v5e:2x2'",
                      "model.moe.first_dense_layers=0", "model.moe.num_shared_experts=0")
  _, setup = dry_run.prepare(exp)
  hlo = dry_run.compile_step(setup).as_text()
  shapes = {"f32[{}]".format(",".join(map(str, a.shape[-3:]))) for p, a in
            jax.tree_util.tree_leaves_with_path(setup.abstract["params"])
            if any(w in jax.tree_util.keystr(p) for w in ("wi_gate", "wi_up", "wo"))}
  assert shapes == {"f32[8,32,32]"}, shapes
  ops = lambda kind: [l for l in hlo.splitlines() if re.search(rf" {kind}(-start)?\(", l)]
  assert not [l for l in ops("all-reduce") if shapes & set(re.findall(r"f32\[[\d,]+\]", l))]
  scattered = [c for c in report.collectives(hlo) if c.kind == "reduce-scatter" and "moe_dispatch.py" in c.source]
  assert len(scattered) == 3, scattered           # w_gate, w_up, wo (both layers: one scanned body)


def test_tpu_fsdp_over_two_axes_reduce_scatters_on_a_3d_torus():
  """On a 3D torus (v5p:2x2x4, 16 chips) libtpu writes one all-gather over all 16 chips, and
  its transpose, as all-reduces: with the expert weights FSDP-split over one 16-way axis the
  compiled step has no reduce-scatter from the dispatch (seen 2026-11-26; at Mixtral's shapes
  on 128 chips, all-reduces of the whole bf16[8,4096,14336] weight: docs/results/moe_pods.md).
  Split over two axes (data 4 x fsdp 4) and gathered one axis at a time, the gradients leave by
  reduce-scatter, and no all-reduce over all 16 chips carries an expert weight (f32[8,32,32],
  32,768 bytes). Gathered over both axes at once (the code before), it fails like one axis."""
  exp = tiny_dropless(None, (4, 4), ("data", "fsdp"), "mesh.topology='v5p:2x2x4'",
                      "sharding.rules=(('batch', ('data', 'fsdp')), ('embed', ('data', 'fsdp')))",
                      "train.global_batch=16", "model.moe.first_dense_layers=0",
                      "model.moe.num_shared_experts=0")
  _, setup = dry_run.prepare(exp)
  colls = report.collectives(dry_run.compile_step(setup).as_text())
  assert [c for c in colls if c.kind == "reduce-scatter" and "moe_dispatch.py" in c.source]
  assert not [c for c in colls if c.kind == "all-reduce" and c.group_size == 16 and c.bytes == 32768]


def test_tpu_fp8_dispatch_sends_what_goes_to_the_experts_by_ragged_all_to_all_in_fp8():
  """model.moe.fp8_dispatch on the ragged exchange, as libtpu compiles it: what goes to the
  experts (the rows forward, the expert outputs' gradient backward; 256-row receive buffers)
  travels as f8e4m3fn with its f32 scales; what comes back (the outputs forward, the rows'
  gradient backward; 64 rows) in f32, the tiny model's dtype. Without fp8_dispatch the same
  step has no f8 op (the test above)."""
  exp = tiny_dropless("expert", (4,), ("data",), "mesh.topology='v5e:2x2'",
                      "model.moe.expert_buffer=None", "model.moe.fp8_dispatch=True")
  _, setup = dry_run.prepare(exp)
  hlo = dry_run.compile_step(setup).as_text()
  ops = re.findall(r"= (\w+)\[(\d+),[^\]]*\]\S* ragged-all-to-all\(", hlo)
  assert sorted(dt for dt, rows in ops if rows == "256") == ["f32", "f32", "f8e4m3fn", "f8e4m3fn", "s32"], ops
  assert [dt for dt, rows in ops if rows == "64"] == ["f32", "f32"], ops
