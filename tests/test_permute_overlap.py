"""What the step model credits an async collective-permute with, read from the schedule:
the compute between its start and done, the loops it spans, and a mirrored partner in flight."""

import numpy as np
import pytest

from shardax.sharding import report
from shardax.perf import costs as costs_lib

# A loop body in schedule order: a ring step each way (mirrored pairs) with a matmul between
# start and done; a third permute with nothing between its start and done; a fourth around a loop.
BODY = """HloModule m, num_partitions=4

%body (p: bf16[64,64]) -> bf16[64,64] {
  %p = bf16[64,64]{1,0} parameter(0)
  %cp-start.0 = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-start.1 = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=2, source_target_pairs={{1,0},{2,1},{3,2},{0,3}}
  %fusion.0 = bf16[64,64]{1,0} fusion(%p, %p), kind=kOutput, calls=%mm
  %cp-done.0 = bf16[64,64]{1,0} collective-permute-done(%cp-start.0)
  %cp-done.1 = bf16[64,64]{1,0} collective-permute-done(%cp-start.1)
  %cp-start.2 = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, u32[], u32[]) collective-permute-start(%fusion.0), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done.2 = bf16[64,64]{1,0} collective-permute-done(%cp-start.2)
  %cp-start.3 = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, u32[], u32[]) collective-permute-start(%cp-done.2), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %while.0 = bf16[64,64]{1,0} while(%p), condition=%cond, body=%inner
  ROOT %cp-done.3 = bf16[64,64]{1,0} collective-permute-done(%cp-start.3)
}
"""


def test_report_reads_what_runs_between_start_and_done():
  found = {c.name: c for c in report.collectives(BODY)}
  assert set(found) == {"cp-start.0", "cp-start.1", "cp-start.2", "cp-start.3"}
  assert found["cp-start.0"].compute_between == 1 and found["cp-start.0"].concurrent_with == ("cp-start.1",)
  assert found["cp-start.2"].compute_between == 0 and not found["cp-start.2"].concurrent_with
  assert found["cp-start.3"].loops_between == ("inner",)


def test_step_model_prices_mirrored_pairs_once_and_bare_permutes_as_exposed():
  """On a v4 ring of 4 chips along a torus dim that wraps (4x4x4): the mirrored pair costs
  one transfer; the permute with nothing between start and done is synchronous (exposed),
  the others are overlapped. On a row without wraparound (v5e:4x4) the pair costs two."""
  pytest.importorskip("libtpu")
  from jax.sharding import Mesh
  from shardax.sharding import topology
  from shardax.perf import hardware, stepmodel
  cs = tuple(report.collectives(BODY))
  piece = costs_lib.Piece("body", 1, 0.0, 0.0, 0.0)
  costs = costs_lib.Costs(0.0, 0.0, 0.0, cs, (), 0.0, (piece,), {"body": "body"})

  def times_on(name):
    devices = sorted(topology.devices(name), key=lambda d: tuple(d.coords)[::-1])[:4]  # along x
    mesh = Mesh(np.array(devices).reshape(4), ("model",))
    return stepmodel._collective_times(costs, mesh, hardware.lookup(devices[0].device_kind))

  line = times_on("v5e:4x4")  # a row of 4 chips: v5e rows wrap from 16
  times = times_on("v4:4x4x4")
  one = times["by_kind"]["collective-permute"] / 3            # 0, 2 and 3 priced, 1 rides on 0
  assert one > 0
  assert times["sync"]["body"] == pytest.approx(one)           # cp-start.2: nothing between
  assert times["async"]["body"] == pytest.approx(one)          # the mirrored pair, as one
  assert sum(times["spanning"]["body"].values()) == pytest.approx(one)   # cp-start.3 spans %inner
  assert line["async"]["body"] == pytest.approx(2 * line["by_kind"]["collective-permute"] / 4)  # both priced


def test_cost_records_read_back_from_json_equal_and_price_the_same():
  """A cached row (benchmarks/calibrate.py writes `to_json`, reads `from_json`) must be the
  record that was written: a collective spanning a loop (`loops_between`), one with a mirrored
  partner (`concurrent_with`), a piece with trips, loops and ops; and the step model prices
  the read-back costs as it priced the fresh ones (it keys a dict by `loops_between`)."""
  import json
  pytest.importorskip("libtpu")
  from jax.sharding import Mesh
  from shardax.sharding import topology
  from shardax.perf import hardware, stepmodel
  cs = tuple(report.collectives(BODY))
  assert any(c.loops_between for c in cs) and any(c.concurrent_with for c in cs)
  piece = costs_lib.Piece("body", 3, 1.0, 2.0, 0.0, trips=(3,), ops=(("xla", "f8e4m3fn", 5.0),),
                          loops=("outer",))
  loop = costs_lib.Loop("inner", 2, 6, 1.0, 2.0)
  fresh = costs_lib.Costs(10.0, 0.0, 2.0, cs, (loop,), 1.0, (piece,), {"body": "body"})
  back = costs_lib.from_json(json.loads(json.dumps(costs_lib.to_json(fresh))))
  assert back == fresh
  devices = sorted(topology.devices("v4:4x4x4"), key=lambda d: tuple(d.coords)[::-1])[:4]
  mesh = Mesh(np.array(devices).reshape(4), ("model",))
  chip = hardware.lookup(devices[0].device_kind)
  assert stepmodel._collective_times(back, mesh, chip) == stepmodel._collective_times(fresh, mesh, chip)
