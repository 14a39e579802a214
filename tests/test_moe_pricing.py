"""Pricing what a capacity MoE step runs, from the chip's physics (perf/hbm.py, perf/stepmodel.py):
small programs compiled for a TPU whose priced terms are counted by hand from their shapes and
the chip's row in perf/hardware.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.sharding import topology
from shardax.perf import costs, hardware, hbm, stepmodel
from shardax.perf import hlo as perf_hlo

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")


class _Exp:   # what from_costs reads of an experiment
  class model:
    @staticmethod
    def flops_per_example(data): return 0
    @staticmethod
    def tokens_per_example(data): return 1
  data, train = None, type("T", (), {"global_batch": 1})


def _one_chip(name: str = "v6e:2x2"):
  return jax.sharding.Mesh(np.array(topology.devices(name)[:1]), ("d",))


def _two_matmuls() -> str:
  """tanh(x @ w1) @ w2 on one v6e chip: the compiler prefetches w2 into on-chip memory with an
  async copy and runs both matmuls as one fusion (the tanh stays on chip)."""
  mesh = _one_chip()
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  f = lambda x, w1, w2: jnp.tanh(x @ w1) @ w2
  return jax.jit(f).lower(spec(1024, 1024), spec(1024, 4096), spec(4096, 1024)).compile().as_text()


@needs_libtpu
def test_hbm_traffic_counts_a_prefetch_once_and_nothing_read_from_on_chip_memory():
  """By hand: x (2 MiB), w1 (8 MiB) and w2 (8 MiB) each cross HBM once, and the result (2 MiB)
  once: 20 MiB. XLA's cost analysis counts the async copy of w2 four times and the fusion's read
  of the on-chip copy again: 52 MiB, which priced at the HBM bandwidth made the step 2.6x slower
  than its traffic."""
  text = _two_matmuls()
  mod = perf_hlo.parse(text)
  assert [i.opcode for i in mod if i.opcode.startswith("copy-")] == ["copy-start", "copy-done"]
  assert hbm.spaces(mod.instructions["copy-done"].shape) == [hbm.ON_CHIP]
  c = costs.of_hlo_text(text)
  mib = 2**20
  (piece,) = c.pieces
  assert piece.bytes_accessed == pytest.approx(52 * mib, rel=1e-3)   # XLA's count
  assert piece.hbm_bytes == pytest.approx(20 * mib, rel=1e-3)
  chip = hardware.lookup("TPU v6 lite")
  pr = stepmodel.from_costs(c, _one_chip(), _Exp, chip)
  assert pr.breakdown["memory_seconds"] == pytest.approx(20 * mib / chip.hbm_bandwidth, rel=1e-3)


def test_memory_spaces_are_read_per_leaf_and_only_a_tpu_program_has_on_chip_buffers():
  assert hbm.spaces("(bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[8,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)})") == [1, 0, 2]
  gpu = perf_hlo.parse("""HloModule m

ENTRY %e (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0:S(1)} negate(%p)
}
""")
  assert not hbm.is_tpu(gpu) and hbm.onchip_bytes(gpu, ["e"]) == 0.0   # a GPU's S(1) is still HBM


def test_costs_cached_before_the_on_chip_reading_price_as_they_did():
  piece = costs.Piece("body", 1, 0.0, 1000.0, 0.0)
  old = costs._record(costs.Piece, {k: v for k, v in piece.__dict__.items() if k != "onchip_bytes"})
  assert old.hbm_bytes == 1000.0
