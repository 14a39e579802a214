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


class StubExperiment:
  """What stepmodel.from_costs reads of an experiment: no model FLOPs, one token, batch 1."""
  class model:
    @staticmethod
    def flops_per_example(data): return 0
    @staticmethod
    def tokens_per_example(data): return 1
  data, train = None, type("T", (), {"global_batch": 1})


def one_chip(name: str = "v6e:2x2"):
  """A one-device mesh (axis 'd') of the first chip of TPU topology `name` (AOT compiles)."""
  return jax.sharding.Mesh(np.array(topology.devices(name)[:1]), ("d",))


def _two_matmuls() -> str:
  """tanh(x @ w1) @ w2 on one v6e chip: the compiler prefetches w2 into on-chip memory with an
  async copy and runs both matmuls as one fusion (the tanh stays on chip)."""
  mesh = one_chip()
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
  assert perf_hlo.memory_spaces(mod.instructions["copy-done"].shape) == [hbm.ON_CHIP]
  c = costs.of_hlo_text(text)
  mib = 2**20
  (piece,) = c.pieces
  assert piece.bytes_accessed == pytest.approx(52 * mib, rel=1e-3)   # XLA's count
  assert piece.hbm_bytes == pytest.approx(20 * mib, rel=1e-3)
  chip = hardware.lookup("TPU v6 lite")
  pr = stepmodel.from_costs(c, one_chip(), StubExperiment, chip)
  assert pr.breakdown["memory_seconds"] == pytest.approx(20 * mib / chip.hbm_bandwidth, rel=1e-3)
  h100 = hardware.lookup("NVIDIA H100 80GB HBM3")   # timed as a GPU (a stand-in): no on-chip buffers there
  stand_in = stepmodel.from_costs(c, one_chip(), StubExperiment, h100)
  assert stand_in.breakdown["memory_seconds"] == pytest.approx(52 * mib / h100.hbm_bandwidth, rel=1e-3)


def test_memory_spaces_are_read_per_leaf_and_only_a_tpu_program_has_on_chip_buffers():
  assert perf_hlo.memory_spaces("(bf16[8,128]{1,0:T(8,128)(2,1)S(1)}, bf16[8,128]{1,0:T(8,128)(2,1)}, u32[]{:S(2)})") == [1, 0, 2]
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


_FSDP_STEP = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from shardax.sharding import topology
mesh = jax.sharding.Mesh(np.array(topology.devices("v5e:2x2")), ("d",))
x = jax.ShapeDtypeStruct((8, 1024, 16384), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
w = jax.ShapeDtypeStruct((4, 16384, 16384), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "d")))
f = lambda x, ws: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0].sum()
open(sys.argv[1], "w").write(jax.jit(jax.grad(f, argnums=1)).lower(x, w).compile().as_text())
"""


def _fsdp_step(path, libtpu_args: str) -> str:
  """The gradient of a 4-layer scanned stack of 16384-wide weights split over 4 v5e chips (FSDP:
  each layer all-gathers 512 MiB of weights, too large for on-chip memory), compiled in a
  process of its own because libtpu reads its flags once."""
  import os, subprocess, sys
  env = dict(os.environ, JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=libtpu_args)
  subprocess.run([sys.executable, "-c", _FSDP_STEP, str(path)], env=env, check=True)
  return path.read_text()


@pytest.mark.slow   # two compiles in fresh processes, ~20 s each on a busy 2-core machine
@needs_libtpu
def test_an_async_collective_moves_no_more_hbm_bytes_than_the_same_collective_kept_synchronous(tmp_path):
  """v5e's async collective fusion carries each in-flight all-gather buffer in place through the
  compute fusions that run beside it (output_to_operand_aliasing), and XLA's cost analysis counts
  its full size read and written again at each of them, at the start and at the done: +39% bytes
  for the same step with the fusion turned off (the TPU compiler then keeps the all-gathers
  synchronous). By physics the buffer is written once where the collective lands; the HBM
  traffic of the two programs is the same step's (within 2%)."""
  hbm_bytes, xla_bytes = {}, {}
  for name, flag in (("async", "true"), ("sync", "false")):
    text = _fsdp_step(tmp_path / f"{name}.hlo", f"--xla_tpu_enable_async_collective_fusion={flag}")
    assert ("async_collective_fusion_config" in text) == (name == "async")
    c = costs.of_hlo_text(text)
    hbm_bytes[name] = sum(p.executions * p.hbm_bytes for p in c.pieces)
    xla_bytes[name] = sum(p.executions * p.bytes_accessed for p in c.pieces)
  assert xla_bytes["async"] > 1.3 * xla_bytes["sync"]
  assert hbm_bytes["async"] == pytest.approx(hbm_bytes["sync"], rel=0.02)
