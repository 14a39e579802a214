"""Peak figures of accelerators, per jax device: the denominators of MFU and rooflines.

One row per chip generation, keyed by jax's `device.device_kind`. All figures are
per *jax device*: for TPU v3, whose two TensorCores are separate jax devices,
that is half a chip (the vendor's per-chip numbers halved); TPU v4 and v5p run
their two cores as one "megacore" device, so per device = per chip.

  peak_bf16_flops  dense bf16 matmul FLOP/s (no sparsity)
  hbm_bytes        HBM capacity in bytes (the vendor's GiB/GB figure; the compiler
                   may reserve a little of it)
  hbm_bandwidth    HBM bytes/s
  ici_bandwidth    chip-to-chip bytes/s of one device, both directions together:
                   TPU ICI (for v3/v4, whose pages give only pod all-reduce
                   bandwidth, 2 x that / chips, which matches the stated figure on
                   v5e and v6e), GPU NVLink. A rough figure for a roofline, not a
                   model of the torus.

Sources are the vendors' pages (Cloud TPU system-architecture pages, NVIDIA
datasheets), as read in 2026; each row names its page.
"""

from __future__ import annotations

import dataclasses

GiB = 1024**3
GB = 1000**3
T = 1e12


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str
  peak_bf16_flops: float
  hbm_bytes: int
  hbm_bandwidth: float
  ici_bandwidth: float
  source: str


_TPU = "https://cloud.google.com/tpu/docs/"
_NV = "https://www.nvidia.com/en-us/data-center/"

CHIPS: dict[str, Chip] = {c.name: c for c in (
    # v3: 123 TFLOPs, 32 GiB, 900 GBps per chip of 2 cores; all-reduce 340 TB/s per 1024-chip pod.
    Chip("TPU v3", 123e12 / 2, 16 * GiB, 900 * GB / 2, 2 * 340e12 / 1024 / 2, _TPU + "v3"),
    # v4: 275 TFLOPs, 32 GiB, 1200 GBps; all-reduce 1.1 PB/s per 4096-chip pod.
    Chip("TPU v4", 275e12, 32 * GiB, 1200 * GB, 2 * 1.1e15 / 4096, _TPU + "v4"),
    # v5e: 197 TFLOPs, 16 GB, 819 GBps, bidirectional ICI 400 GBps.
    Chip("TPU v5 lite", 197e12, 16 * GiB, 819 * GB, 400 * GB, _TPU + "v5e"),
    # v5p: 459 TFLOPs, 95 GiB, 2765 GBps, bidirectional ICI 1200 GBps.
    Chip("TPU v5", 459e12, 95 * GiB, 2765 * GB, 1200 * GB, _TPU + "v5p"),
    # v6e (Trillium): 918 TFLOPs, 32 GB, 1638 GBps, bidirectional ICI 800 GBps.
    Chip("TPU v6 lite", 918e12, 32 * GiB, 1638 * GB, 800 * GB, _TPU + "v6e"),
    # A100 SXM: 312 TFLOPs bf16 dense; 80 GB HBM2e at 2039 GB/s (40 GB: 1555); NVLink 600 GB/s.
    Chip("NVIDIA A100-SXM4-80GB", 312e12, 80 * GiB, 2039 * GB, 600 * GB, _NV + "a100/"),
    Chip("NVIDIA A100-SXM4-40GB", 312e12, 40 * GiB, 1555 * GB, 600 * GB, _NV + "a100/"),
    Chip("NVIDIA A100 80GB PCIe", 312e12, 80 * GiB, 1935 * GB, 600 * GB, _NV + "a100/"),
    Chip("NVIDIA A100-PCIE-40GB", 312e12, 40 * GiB, 1555 * GB, 600 * GB, _NV + "a100/"),
    # H100 SXM: 989 TFLOPs bf16 dense (1979 with sparsity); 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s.
    Chip("NVIDIA H100 80GB HBM3", 989e12, 80 * GiB, 3350 * GB, 900 * GB, _NV + "h100/"),
    Chip("NVIDIA H100 PCIe", 756e12, 80 * GiB, 2000 * GB, 600 * GB, _NV + "h100/"),
    Chip("NVIDIA H100 NVL", 835e12, 94 * GiB, 3900 * GB, 600 * GB, _NV + "h100/"),
    # H200 SXM: 989 TFLOPs bf16 dense; 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s.
    Chip("NVIDIA H200", 989e12, 141 * GiB, 4800 * GB, 900 * GB, _NV + "h200/"),
)}

# Other spellings jax reports for the same parts (driver and form-factor variants).
_PREFIXES = (
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"),
    ("NVIDIA A100-SXM", "NVIDIA A100-SXM4-80GB"),
    ("NVIDIA A100-PCIE-40GB", "NVIDIA A100-PCIE-40GB"),
    ("NVIDIA A100", "NVIDIA A100 80GB PCIe"),
    ("TPU v5p", "TPU v5"),
    ("TPU v5e", "TPU v5 lite"),
    ("TPU v6e", "TPU v6 lite"),
)


def lookup(device_kind: str) -> Chip | None:
  """The row for a jax `device_kind` ("TPU v4", "TPU v5 lite", "NVIDIA H100 80GB HBM3"), else None."""
  kind = device_kind.strip()
  if kind in CHIPS:
    return CHIPS[kind]
  for prefix, name in _PREFIXES:
    if kind.startswith(prefix):
      return CHIPS[name]
  return None
