"""A GPU runs a program's kernels one after another: the traffic of a kernel with no matmul in
it (perf/kernels.py) is time of its own, not hidden under the matmuls of its piece as a TPU's
prefetched operands are (perf/stepmodel.py assumption 2)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax.perf import costs as costs_lib
from shardax.perf import hardware, kernels, step_report, stepmodel
from shardax.perf import hlo as perf_hlo
from test_moe_pricing import StubExperiment



def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))


def _matmul_beside_an_update() -> str:
  """x @ w (2 + 2 MiB in, 1 MiB out) and, apart from it, an elementwise update of a 64 MiB array
  (read, written): two kernels, only one of which multiplies matrices."""
  f = lambda x, w, z: (x @ w, z * 0.9 + 1.0)
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return jax.jit(f).lower(spec(512, 1024), spec(1024, 512), spec(4096, 4096)).compile().as_text()


def test_the_traffic_of_kernels_without_a_matmul_is_read_from_the_program():
  text = _matmul_beside_an_update()
  share = kernels.matmul_free_share(perf_hlo.parse(text), [perf_hlo.parse(text).entry])
  # 128 MiB of the update against 5 MiB of the matmul: the share is the update's
  assert share == pytest.approx(128 / (128 + 5), abs=0.01)
  [main] = costs_lib.of_hlo_text(text).pieces
  assert main.matmul_free_bytes == pytest.approx(share * main.bytes_accessed)
  only_matmul = jax.jit(lambda x, w: x @ w).lower(jnp.ones((512, 1024)), jnp.ones((1024, 512))).compile().as_text()
  assert costs_lib.of_hlo_text(only_matmul).pieces[0].matmul_free_bytes == 0.0


def test_a_gpu_pays_an_elementwise_kernel_beside_its_matmuls_and_a_tpu_hides_it():
  """A piece of 10 ms of matmuls that moves 6 ms of traffic, 3 ms of it in an elementwise kernel:
  on an H100 the elementwise kernel runs alone (13 ms); a TPU's compiler prefetches its operands
  under the matmuls (10 ms). Before this reading both were priced max(compute, memory)."""
  h100, tpu = hardware.lookup("NVIDIA H100 80GB HBM3"), hardware.lookup("TPU v5")
  for chip, want in ((h100, 13e-3), (tpu, 10e-3)):
    flops = 10e-3 * chip.peak_bf16_flops * chip.matmul_efficiency
    piece = costs_lib.Piece("main", 1, flops, 6e-3 * chip.hbm_bandwidth, 0.0,
                            matmul_free_bytes=3e-3 * chip.hbm_bandwidth)
    costs = costs_lib.Costs(flops, 0.0, piece.bytes_accessed, (), (), flops, (piece,), {"main": "main"})
    pr = stepmodel.from_costs(costs, _mesh(), StubExperiment, chip)
    assert pr.step_seconds == pytest.approx(want, rel=1e-3), chip.name
    said = "(0.003 s of it in kernels without a matmul" in "\n".join(step_report.format_prediction(pr))
    assert said == (chip is h100), chip.name   # the report says where the GPU's extra time went


def test_a_deepened_entry_counts_its_grown_stack_traffic_as_kernels_without_matmuls():
  """The optimizer update and the copies of a scanned stack's [L, ...] weights outside the layer
  loop grow with depth (costs.deepen) and run no matmul."""
  piece = costs_lib.Piece("main", 1, 0.0, 100.0, 0.0, stacked=((3, 0.6, 0.0),), matmul_free_bytes=70.0)
  costs = costs_lib.Costs(0.0, 0.0, 100.0, (), (), 0.0, (piece,), {"main": "main"})
  [deep] = costs_lib.deepen(costs, 3, 30, 10.0).pieces
  assert deep.bytes_accessed == pytest.approx(100 + 60 * 9)
  assert deep.matmul_free_bytes == pytest.approx(70 + 60 * 9)
  assert costs_lib.from_json(costs_lib.to_json(costs_lib.Costs(0.0, 0.0, 0.0, (), (), 0.0, (deep,), {}))).pieces == (deep,)
