"""The chip table against what libtpu itself knows of each TPU generation (perf/hardware.py).

The table's figures are read off datasheets; libtpu's topology descriptions are a second,
independent source for two of them: how many jax devices a chip is (TPU v3 and TPU7x: two
TensorCores, each its own device), and how much HBM the compiler lets one device use (a
little under the datasheet's capacity). A wrong row (per chip where per device is meant, GB
for GiB, a wrong generation) fails here."""

import ast
import dataclasses
import pathlib

import jax
import numpy as np
import pytest

from shardax.sharding import topology
from shardax.perf import hardware, dry_run

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")

# One small slice per generation the table prices, 3D generations on 2x2x1.
SLICES = {"v3": "v3:2x2", "v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2",
          "tpu7x": "tpu7x:2x2x1"}


@needs_libtpu
@pytest.mark.parametrize("gen", sorted(SLICES))
def test_each_tpu_rows_devices_per_chip_and_hbm_agree_with_libtpu(gen):
  devices = topology.devices(SLICES[gen])
  chip = hardware.lookup(devices[0].device_kind)
  assert chip is not None, f"{devices[0].device_kind!r} has no row in the chip table"
  per_chip = len(devices) // topology.num_chips(SLICES[gen])
  assert chip.devices_per_chip == per_chip
  mesh = jax.sharding.Mesh(np.array(devices[:1]), ("d",))
  usable = dry_run.usable_hbm_bytes(mesh, chip)
  assert usable is not None
  # the compiler keeps 1-4% back (v6e 31.25 of 32 GiB, v5e 15.48 of 16, TPU7x 94.75 of 96)
  assert 0.9 * chip.hbm_bytes <= usable <= chip.hbm_bytes, (gen, usable / 2**30, chip.hbm_bytes / 2**30)


def test_tpu7x_is_priced_per_device_at_half_its_chip():
  c = hardware.lookup("TPU7x")
  assert (c.peak_bf16_flops, c.peak_fp8_flops, c.hbm_bytes) == (2307e12 / 2, 4614e12 / 2, 96 * 2**30)
  assert (c.torus_dims, c.devices_per_chip) == (3, 2)


def test_a_tpu_chips_host_link_is_shared_by_its_devices():
  """Every TPU chip has the same PCIe link to its host; a chip run as two devices (v3, TPU7x)
  gives each device half of it, so offload is not priced at twice the chip's link."""
  tpus = [c for c in hardware.CHIPS.values() if c.torus_dims]
  assert {c.host_bandwidth * c.devices_per_chip for c in tpus} == {1.5e10}
  assert {c.devices_per_chip for c in tpus} == {1, 2}


def test_every_chip_row_sources_every_field():
  """One table: each row gives each figure with where it comes from; a figure left at 0 says why."""
  for c in hardware.CHIPS.values():
    missing = [f for f in hardware.SOURCED_FIELDS if not c.sources.get(f)]
    assert not missing, f"{c.name}: no source for {missing}"
    unexplained = [f for f in hardware.SOURCED_FIELDS if not getattr(c, f)
                   and not c.sources[f].startswith(("n/a", "not published", "no "))]
    assert not unexplained, f"{c.name}: {unexplained} are 0 without saying why"


def test_a_row_without_a_source_for_a_field_or_with_an_unknown_one_is_refused_naming_it():
  """The table refuses to build with a figure whose origin is not given, or a source for a field
  that does not exist (a typo in a row would otherwise leave the real field unsourced)."""
  v4 = hardware.CHIPS["TPU v4"]
  fields = {f.name: getattr(v4, f.name) for f in dataclasses.fields(v4)}
  with pytest.raises(ValueError, match=r"'TPU v4'.*\['clock_hz'\]"):
    hardware.Chip(**fields | {"sources": {k: s for k, s in v4.sources.items() if k != "clock_hz"}})
  with pytest.raises(ValueError, match=r"unknown fields \['clock_mhz'\]"):
    hardware.Chip(**fields | {"sources": v4.sources | {"clock_mhz": "a typo"}})


def test_the_chip_table_is_a_leaf_that_sharding_may_import():
  """perf/hardware.py imports nothing from shardax, so sharding/mesh.py can import NETWORKS at its
  top without an arrow running back up (perf/ imports sharding/)."""
  tree = ast.parse(pathlib.Path(hardware.__file__).read_text())
  imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  imported += ["." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  assert not [m for m in imported if m.startswith((".", "shardax"))], imported


def test_tpu_peaks_agree_with_their_mxu_geometry_where_a_clock_is_published():
  """2 FLOPs x multiply-adds per cycle (cores x MXUs x side^2) x clock is the datasheet peak per
  chip: a row with the wrong MXU count, side or per-device split fails here."""
  checked = 0
  for c in hardware.CHIPS.values():
    if c.torus_dims and c.clock_hz:
      peak = 2 * c.cores_per_chip * c.mxus_per_core * c.mxu_dim ** 2 * c.clock_hz
      assert peak == pytest.approx(c.peak_bf16_flops * c.devices_per_chip, rel=0.01), c.name
      checked += 1
  assert checked >= 2   # v3 and v4 publish their clocks


def test_v6e_has_256_wide_mxus_and_the_earlier_tpus_128():
  assert hardware.lookup("TPU v6 lite").mxu_dim == 256
  assert {hardware.lookup(k).mxu_dim for k in ("TPU v3", "TPU v4", "TPU v5 lite", "TPU v5")} == {128}
