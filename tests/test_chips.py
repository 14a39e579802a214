"""The chip table against what libtpu itself knows of each TPU generation (trainer/perf/chips.py).

The table's figures are read off datasheets; libtpu's topology descriptions are a second,
independent source for two of them: how many jax devices a chip is (TPU v3 and TPU7x: two
TensorCores, each its own device), and how much HBM the compiler lets one device use (a
little under the datasheet's capacity). A wrong row (per chip where per device is meant, GB
for GiB, a wrong generation) fails here."""

import jax
import numpy as np
import pytest

from shardax.sharding import topology
from shardax.trainer.perf import chips, dry_run

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")

# One small slice per generation the table prices, 3D generations on 2x2x1.
SLICES = {"v3": "v3:2x2", "v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2",
          "tpu7x": "tpu7x:2x2x1"}


@needs_libtpu
@pytest.mark.parametrize("gen", sorted(SLICES))
def test_each_tpu_rows_devices_per_chip_and_hbm_agree_with_libtpu(gen):
  devices = topology.devices(SLICES[gen])
  chip = chips.lookup(devices[0].device_kind)
  assert chip is not None, f"{devices[0].device_kind!r} has no row in the chip table"
  per_chip = len(devices) // topology.num_chips(SLICES[gen])
  assert chip.devices_per_chip == per_chip
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("d",))
  usable = dry_run.usable_hbm_bytes(mesh, chip)
  assert usable is not None
  # the compiler keeps 1-4% back (v6e 31.25 of 32 GiB, v5e 15.48 of 16, TPU7x 94.75 of 96)
  assert 0.9 * chip.hbm_bytes <= usable <= chip.hbm_bytes, (gen, usable / 2**30, chip.hbm_bytes / 2**30)


def test_tpu7x_is_priced_per_device_at_half_its_chip():
  c = chips.lookup("TPU7x")
  assert (c.peak_bf16_flops, c.peak_fp8_flops, c.hbm_bytes) == (2307e12 / 2, 4614e12 / 2, 96 * 2**30)
  assert (c.torus_dims, c.devices_per_chip) == (3, 2)
