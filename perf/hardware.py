"""Peak figures of accelerators, per jax device: the denominators of MFU and rooflines.

One row per chip generation, keyed by jax's `device.device_kind`. All figures are
per *jax device*: for TPU v3, whose two TensorCores are separate jax devices,
that is half a chip (the vendor's per-chip numbers halved); TPU v4 and v5p run
their two cores as one "megacore" device, so per device = per chip.

  peak_bf16_flops  dense bf16 matmul FLOP/s (no sparsity)
  peak_int8_flops, peak_fp8_flops  dense int8 OP/s and fp8 FLOP/s where the chip has units
                   for them (0: none; an 8-bit dot there runs at the bf16 rate, which is
                   what XLA does with it: widen the operands)
  hbm_bytes        HBM capacity in bytes (the vendor's GiB/GB figure; the compiler
                   may reserve a little of it)
  hbm_bandwidth    HBM bytes/s
  ici_bandwidth    chip-to-chip bytes/s of one device, both directions together:
                   TPU ICI (for v3/v4, whose pages give only pod all-reduce
                   bandwidth, 2 x that / chips, which matches the stated figure on
                   v5e and v6e), GPU NVLink. A rough figure for a roofline, not a
                   model of the torus; the step-time model uses the per-link
                   figures below.
  ici_link_bandwidth  bytes/s one way over one chip-to-chip link (TPU ICI), or one
                   GPU's NVLink bandwidth one way (NVSwitch: any peer at full rate).
  torus_dims       how many dims the slice's torus has (TPU 2 or 3; GPUs 0: NVSwitch).
  wraparound_from  a slice dim of at least this many chips closes into a ring (its
                   ends are linked); smaller dims are open chains (half the bandwidth
                   for a ring algorithm). 0 = never.
  dcn_bandwidth    bytes/s one way per jax device (per chip; per GPU) over the
                   data-center network between granules (TPU slices, GPU/CPU hosts:
                   sharding/mesh.granule_of): the host's NIC bandwidth shared by the
                   devices of that host, each of which sends its own part of a
                   cross-granule collective at once. Sources below.
  devices_per_chip 2 for TPU v3 (each TensorCore is a jax device; the two share a
                   chip and talk through it), else 1.
  matmul_efficiency  the fraction of peak a large bf16 matmul fused by XLA reaches when no
                   dim pads (see stepmodel.py); what padding to the MXU tile costs a given
                   program is computed from its dot shapes (perf/mxu.py, `mxu_dim`).
  cores_per_chip, mxus_per_core, mxu_dim, clock_hz  the matrix hardware per chip: TPU
                   TensorCores, MXUs per core and the MXU's side (a mxu_dim x mxu_dim systolic
                   array); GPUs: SMs, tensor cores per SM, mxu_dim 0 (no weight-stationary
                   array to pad to). 0 where no page read gives the figure (see `sources`).
  ici_links_per_chip  TPU ICI ports of a chip (4 on the 2D tori, 6 on the 3D tori); GPUs 0.
  sources          field -> where its number comes from (a URL, a paper, or a derivation);
                   tests/test_hardware.py checks every row names one for every field.
Vector-unit throughput is not a field: the step model prices elementwise work at the matmul
rate and its memory traffic at the HBM rate (stepmodel.py, assumption 1), so no row needs it.

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
  ici_link_bandwidth: float = 0.0
  torus_dims: int = 0
  wraparound_from: int = 0
  dcn_bandwidth: float = 0.0
  devices_per_chip: int = 1
  matmul_efficiency: float = 0.8
  host_bandwidth: float = 0.0         # bytes/s one way between a device and its host's memory
  peak_int8_flops: float = 0.0
  peak_fp8_flops: float = 0.0
  cores_per_chip: int = 0
  mxus_per_core: int = 0
  mxu_dim: int = 0
  clock_hz: float = 0.0
  ici_links_per_chip: int = 0
  sources: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


_TPU = "https://cloud.google.com/tpu/docs/"
_NV = "https://www.nvidia.com/en-us/data-center/"
# Per-link ICI (one way) and per-chip DCN figures: "How to scale your model", part 2
# (https://jax-ml.github.io/scaling-book/tpus): ICI 1e11 B/s (v3), 4.5e10 (v4, v5e),
# 9e10 (v5p, v6e) per link and direction; DCN ~6.25e9 B/s per chip. A full torus
# dim (wraparound) needs 16 chips on 2D tori (v5e, v6e: only full 16-chip rows wrap)
# and 4 on 3D tori (v4, v5p: cube faces join through the optical switches), v3 pods
# are 2D tori that wrap from 4. GPUs: NVLink 4 is 900 GB/s per H100 both ways; A3 VMs
# (a3-highgpu-8g) have 4 x 200 Gbit/s NICs (GPUDirect-TCPX) for 8 GPUs = 12.5 GB/s each.
# v5e and v6e are from their datasheets (checked 2026-11-23, docs.cloud.google.com/tpu/docs/v5e
# and /v6e): bidirectional ICI 400 / 800 GBps per chip over 4 ports = 50 / 100 GB/s one way per
# link; v5e hosts have 2 x 100 Gbps NICs for 8 chips = 3.125 GB/s per chip (the pod's 6.4 Tbps
# of DCN over 256 chips agrees); the v6e page gives no NIC figure: the scaling book's 12.5 GB/s
# per chip stands. The DCN figures are per chip (a host's NICs shared by its chips).
# The v5p page (checked 2026-11-25) lists DCN 50 Gbps per chip = 6.25 GB/s, as used here.
# TPU7x (Ironwood): a 3D torus like v5p (libtpu names its slices tpu7x:AxBxC, 2 devices per
# chip); 1.2 TB/s bidirectional ICI per chip (Google's Ironwood announcement, 2025-04) over 6
# ports = 1e11 B/s one way per link; its DCN figure was not found: v5p's 6.25 GB/s per chip.
_TPU_LINKS = {"TPU v3": (1e11, 2, 4, 3.125e9, 2), "TPU v4": (4.5e10, 3, 4, 6.25e9, 1),
              "TPU v5 lite": (5e10, 2, 16, 3.125e9, 1), "TPU v5": (9e10, 3, 4, 6.25e9, 1),
              "TPU v6 lite": (1e11, 2, 16, 1.25e10, 1), "TPU7x": (1e11, 3, 4, 6.25e9, 2)}

CHIPS: dict[str, Chip] = {c.name: c for c in (
    # v3: 123 TFLOPs, 32 GiB, 900 GBps per chip of 2 cores; all-reduce 340 TB/s per 1024-chip pod.
    Chip("TPU v3", 123e12 / 2, 16 * GiB, 900 * GB / 2, 2 * 340e12 / 1024 / 2, _TPU + "v3"),
    # v4: 275 TFLOPs, 32 GiB, 1200 GBps; all-reduce 1.1 PB/s per 4096-chip pod.
    Chip("TPU v4", 275e12, 32 * GiB, 1200 * GB, 2 * 1.1e15 / 4096, _TPU + "v4"),
    # v5e: 197 TFLOPs (int8 393 TOPs), 16 GB, 819 GBps, bidirectional ICI 400 GBps (datasheet, 2026-11-23).
    Chip("TPU v5 lite", 197e12, 16 * GiB, 819 * GB, 400 * GB, _TPU + "v5e"),
    # v5p: 459 TFLOPs, 2765 GBps, bidirectional ICI 1200 GBps. Its page says 95 GiB of HBM, but
    # libtpu's compiler lets one device use 95.74 GiB (tests/test_hardware.py): the part holds 96 GiB.
    Chip("TPU v5", 459e12, 96 * GiB, 2765 * GB, 1200 * GB, _TPU + "v5p"),
    # v6e (Trillium): 918 TFLOPs (int8 1836 TOPs), 32 GB, 1638 GBps, bidirectional ICI 800 GBps
    # (datasheet, 2026-11-23).
    Chip("TPU v6 lite", 918e12, 32 * GiB, 1638 * GB, 800 * GB, _TPU + "v6e"),
    # TPU7x (Ironwood), per chip of two devices: 2307 TFLOPs bf16, 4614 fp8, 192 GiB HBM (the
    # tpu7x page's table, read 2026-11-25); 7.37 TB/s HBM and 1.2 TB/s bidirectional ICI
    # (Google's Ironwood announcement, 2025-04: the page's table was not read that far).
    Chip("TPU7x", 2307e12 / 2, 192 * GiB // 2, 7370 * GB / 2, 1200 * GB / 2, _TPU + "tpu7x"),
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
    # B200 (HGX B200): 2250 TFLOPs bf16 dense (36 PF sparse for 8); 180 GB HBM3e at 7.7 TB/s
    # (62 TB/s for 8); NVLink 5 1800 GB/s.
    Chip("NVIDIA B200", 2250e12, 180 * GiB, 7700 * GB, 1800 * GB, _NV + "hgx/"),
)}


# Data-center networks between the hosts of GPU clusters (`mesh.network`), bytes/s one way per
# GPU: the node's GPU NICs shared by its 8 GPUs. A GPU row without a named network gets
# "a3-high" (the calibration rows' A3 VMs). Sources, as read 2026-11-25: Google Cloud's GPU
# machine pages and GKE's GPUDirect-TCPX(O) guide (A3 High: 4 x 200 Gbps GPUDirect-TCPX NICs
# for 8 GPUs; A3 Mega: 8 x 200 Gbps GPUDirect-TCPXO, one per GPU; A3 Ultra (H200) and A4 (B200):
# one 400 Gbps ConnectX-7 RoCE NIC per GPU); NVIDIA DGX H100 / DGX B200 user guides (one
# 400 Gb/s ConnectX-7 InfiniBand NDR port per GPU; DGX A100: 200 Gb/s HDR). Line rates: what
# NCCL reaches is below them (~80-90% on RoCE/InfiniBand).
NETWORKS: dict[str, float] = {
    "a3-high": 4 * 200e9 / 8 / 8, "a3-mega": 200e9 / 8, "a3-ultra": 400e9 / 8, "a4": 400e9 / 8,
    "infiniband-ndr": 400e9 / 8, "infiniband-hdr": 200e9 / 8}


def _with_links(chip: Chip) -> Chip:
  if chip.name in _TPU_LINKS:
    link, dims, wrap, dcn, per_chip = _TPU_LINKS[chip.name]
    return dataclasses.replace(chip, ici_link_bandwidth=link, torus_dims=dims, wraparound_from=wrap,
                               dcn_bandwidth=dcn, devices_per_chip=per_chip,
                               matmul_efficiency=MATMUL_EFFICIENCY["tpu"])
  # GPUs: NVLink one way = half the bidirectional figure; network per GPU as for A3 High
  # (`mesh.network` names another cluster's).
  return dataclasses.replace(chip, ici_link_bandwidth=chip.ici_bandwidth / 2, dcn_bandwidth=NETWORKS["a3-high"],
                             matmul_efficiency=MATMUL_EFFICIENCY["gpu"])


# What large bf16 matmuls reach of the datasheet peak: one figure per family, not per row.
# TPU: set before the published TPU rows were compared (docs/scale.md, "Checked against
# published runs"). GPU: measured, lm.1b on one H100 SXM (docs/performance.md, "On one H100
# GPU", 2026-11-23): its cuBLAS and Triton gemm kernels ran 2.43e14 FLOPs in 65.3% of a
# 0.5175 s step, 0.73 of 989 TFLOP/s. Per-op efficiencies (attention) are in ops.py.
MATMUL_EFFICIENCY = {"tpu": 0.8, "gpu": 0.73}

CHIPS = {name: _with_links(c) for name, c in CHIPS.items()}

# Host link (PCIe) one way per jax device: what offloaded activations (model.remat='offload*')
# cross twice per step. TPUs: 1.5e10 B/s per chip ("How to scale your model", part 2,
# https://jax-ml.github.io/scaling-book/tpus: "PCIe bandwidth ~1.5e10 bytes/s" per chip);
# TPU v3's two cores share their chip's link. GPUs: the datasheets' PCIe generation x16,
# one way (A100 Gen4 32 GB/s, H100/H200 Gen5 64 GB/s; an upper bound: real copies reach ~80%).
_HOST_LINK = {"TPU v3": 1.5e10 / 2, "TPU v4": 1.5e10, "TPU v5 lite": 1.5e10, "TPU v5": 1.5e10,
              "TPU v6 lite": 1.5e10, "TPU7x": 1.5e10 / 2}
CHIPS = {name: dataclasses.replace(c, host_bandwidth=_HOST_LINK.get(name, (32 if "A100" in name else 64) * GB))
         for name, c in CHIPS.items()}

# 8-bit peaks, dense, per jax device (int8 OP/s, fp8 FLOP/s); where a chip has no such units
# the field stays 0 and an 8-bit dot is priced at the bf16 rate. Sources, as read 2026-11-25:
# Cloud TPU system-architecture pages (v4: 275 TOPS int8; v5e: 393 TOPS int8; v5p: 918 TOPS
# int8; v6e: 1836 TOPS int8; none lists fp8 units for these generations), NVIDIA datasheets
# (A100: 624 TOPS int8, no fp8; H100 SXM and H200: 1979 TFLOPS fp8 and 1979 TOPS int8 dense
# (3958 with sparsity); H100 PCIe 1513; H100 NVL 1671; B200 (HGX B200 page, 72 PFLOPS fp8
# with sparsity for 8 GPUs): 4500 dense); TPU7x: 4614 TFLOPS fp8 per chip (its page; no int8
# figure there: int8 is priced at the bf16 rate).
_EIGHT_BIT = {"TPU v4": (275e12, 0.0), "TPU v5 lite": (393e12, 0.0), "TPU v5": (918e12, 0.0),
              "TPU v6 lite": (1836e12, 0.0), "TPU7x": (0.0, 4614e12 / 2), "NVIDIA A100-SXM4-80GB": (624e12, 0.0),
              "NVIDIA A100-SXM4-40GB": (624e12, 0.0), "NVIDIA A100 80GB PCIe": (624e12, 0.0),
              "NVIDIA A100-PCIE-40GB": (624e12, 0.0), "NVIDIA H100 80GB HBM3": (1979e12, 1979e12),
              "NVIDIA H100 PCIe": (1513e12, 1513e12), "NVIDIA H100 NVL": (1671e12, 1671e12),
              "NVIDIA H200": (1979e12, 1979e12), "NVIDIA B200": (4500e12, 4500e12)}
CHIPS = {name: dataclasses.replace(c, peak_int8_flops=_EIGHT_BIT.get(name, (0.0, 0.0))[0],
                                   peak_fp8_flops=_EIGHT_BIT.get(name, (0.0, 0.0))[1])
         for name, c in CHIPS.items()}

# The matrix hardware of each chip: (cores per chip, MXUs per core, MXU side, clock Hz, ICI ports
# per chip), with where each came from. A clock is given only where a source states it; where it
# does, tests/test_hardware.py checks 2 x cores x MXUs x side^2 x clock against the peak above.
_V3_PAPER = ("Jouppi et al., 'A Domain-Specific Supercomputer for Training Deep Neural Networks', "
             "CACM 63(7), 2020, https://doi.org/10.1145/3360307 (TPU v3: 2 TensorCores of 2 MXUs, 940 MHz)")
_V4_PAPER = ("Jouppi et al., 'TPU v4: An Optically Reconfigurable Supercomputer for Machine Learning', "
             "ISCA 2023, https://doi.org/10.1145/3579371.3589350 (2 TensorCores of 4 MXUs, 1050 MHz, 6 ICI links)")
_ARCH = ("https://cloud.google.com/tpu/docs/system-architecture-tpu-vm ('an MXU is 256 x 256 (v6e) or "
         "128 x 128 (earlier versions) multiply-accumulators')")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (https://resources.nvidia.com/"
            "en-us-tensor-core): 132 SMs (SXM5), 114 (PCIe), 4 tensor cores per SM")
_A100_WP = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper (https://images.nvidia.com/aem-dam/en-zz/"
            "Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf): 108 SMs, 4 tensor cores, 1410 MHz")
_NO_ARRAY = "n/a: GPU tensor cores take small fragments and the GEMM kernel picks its tiles; no array pads"
_UNREAD = "not published on the pages read (left 0: nothing uses it)"
_PHYSICS = {
    "TPU v3": ((2, 2, 128, 940e6, 4), {"cores_per_chip": _V3_PAPER, "mxus_per_core": _V3_PAPER,
               "mxu_dim": _ARCH, "clock_hz": _V3_PAPER, "ici_links_per_chip": _TPU + "v3 (2D torus, 4 ports)"}),
    "TPU v4": ((2, 4, 128, 1050e6, 6), dict.fromkeys(("cores_per_chip", "mxus_per_core", "clock_hz",
               "ici_links_per_chip"), _V4_PAPER) | {"mxu_dim": _ARCH}),
    "TPU v5 lite": ((1, 4, 128, 0.0, 4), {"cores_per_chip": _TPU + "v5e ('each v5e chip contains one TensorCore')",
                    "mxus_per_core": _TPU + "v5e ('four matrix-multiply units')", "mxu_dim": _ARCH,
                    "clock_hz": _UNREAD, "ici_links_per_chip": _TPU + "v5e ('ICI ports per chip: 4')"}),
    "TPU v5": ((2, 4, 128, 0.0, 6), {"cores_per_chip": _TPU + "v5p (the topology table: 8 cores per 4 chips)",
               "mxus_per_core": _TPU + "v5p ('each TensorCore has four MXUs')", "mxu_dim": _ARCH,
               "clock_hz": _UNREAD, "ici_links_per_chip": _TPU + "v5p (3D torus: 6 neighbours)"}),
    "TPU v6 lite": ((1, 2, 256, 0.0, 4), {"cores_per_chip": _TPU + "v6e ('each v6e chip contains one TensorCore')",
                    "mxus_per_core": _TPU + "v6e ('two 256x256 matrix-multiply units')",
                    "mxu_dim": _TPU + "v6e ('256x256 matrix-multiply units')", "clock_hz": _UNREAD,
                    "ici_links_per_chip": _TPU + "v6e ('ICI ports per chip: 4')"}),
    "TPU7x": ((2, 0, 0, 0.0, 6), {"cores_per_chip": _TPU + "tpu7x (two TensorCores, each a jax device)",
              "mxus_per_core": _UNREAD, "mxu_dim": _UNREAD + "; no padding priced", "clock_hz": _UNREAD,
              "ici_links_per_chip": _TPU + "tpu7x (3D torus: 6 neighbours)"}),
}
for _name, _sms, _clock in (("NVIDIA A100-SXM4-80GB", 108, 1410e6), ("NVIDIA A100-SXM4-40GB", 108, 1410e6),
                            ("NVIDIA A100 80GB PCIe", 108, 1410e6), ("NVIDIA A100-PCIE-40GB", 108, 1410e6),
                            ("NVIDIA H100 80GB HBM3", 132, 0.0), ("NVIDIA H100 PCIe", 114, 0.0),
                            ("NVIDIA H100 NVL", 132, 0.0), ("NVIDIA H200", 132, 0.0), ("NVIDIA B200", 0, 0.0)):
  _wp = _A100_WP if "A100" in _name else _H100_WP if _sms else _UNREAD
  _PHYSICS[_name] = ((_sms, 4 if _sms else 0, 0, _clock, 0), {
      "cores_per_chip": _wp, "mxus_per_core": _wp, "mxu_dim": _NO_ARRAY,
      "clock_hz": _wp if _clock else _UNREAD + " (boost clocks differ by SKU)",
      "ici_links_per_chip": "n/a: NVLink through NVSwitch, any peer at full rate (ici_link_bandwidth)"})

_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus ('How to scale your model', part 2)"


def _sources(chip: Chip, physics: dict) -> dict:
  """Field -> source for one row: its datasheet page for the datasheet figures, the comments
  above for the link, network and host figures, `_PHYSICS` for the matrix hardware."""
  tpu = chip.torus_dims > 0
  links = (chip.source + " / " + _SCALING_BOOK
           if tpu else chip.source + " (NVLink, one way = half the bidirectional figure)")
  return {"peak_bf16_flops": chip.source, "hbm_bytes": chip.source, "hbm_bandwidth": chip.source,
          "ici_bandwidth": chip.source, "ici_link_bandwidth": links,
          "torus_dims": links if tpu else "n/a: NVSwitch (0)", "wraparound_from": links if tpu else "n/a (0)",
          "dcn_bandwidth": links if tpu else "https://cloud.google.com/compute/docs/gpus (A3 High: 4 x 200 Gbps "
                                             "NICs per 8 GPUs; NETWORKS for others)",
          "devices_per_chip": "libtpu's topology description (tests/test_hardware.py)" if tpu else "one GPU, one device",
          "host_bandwidth": _SCALING_BOOK if tpu else chip.source + " (PCIe generation x16, one way)",
          "peak_int8_flops": chip.source if chip.peak_int8_flops else "no int8 units listed: priced at bf16 (0)",
          "peak_fp8_flops": chip.source if chip.peak_fp8_flops else "no fp8 units listed: priced at bf16 (0)",
          "matmul_efficiency": ("docs/scale.md 'Checked against published runs' (0.8: large unpadded matmuls, "
                                "set before the published rows were compared)" if tpu else
                                "docs/performance.md 'On one H100 GPU' (0.73, measured 2026-11-23)"),
          **physics}


def _with_physics(chip: Chip) -> Chip:
  (cores, mxus, side, clock, ports), physics = _PHYSICS[chip.name]
  chip = dataclasses.replace(chip, cores_per_chip=cores, mxus_per_core=mxus, mxu_dim=side, clock_hz=clock,
                             ici_links_per_chip=ports)
  return dataclasses.replace(chip, sources=_sources(chip, physics))


CHIPS = {name: _with_physics(c) for name, c in CHIPS.items()}
SOURCED_FIELDS = tuple(f.name for f in dataclasses.fields(Chip) if f.name not in ("name", "source", "sources"))

# Other spellings jax reports for the same parts (driver and form-factor variants).
_PREFIXES = (
    ("NVIDIA B200", "NVIDIA B200"),
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
    ("TPU v7", "TPU7x"),
)


def lookup(device_kind: str, network: str | None = None) -> Chip | None:
  """The row for a jax `device_kind` ("TPU v4", "TPU v5 lite", "NVIDIA H100 80GB HBM3"), else
  None; `network` (a NETWORKS name, `mesh.network`) replaces its DCN figure."""
  kind = device_kind.strip()
  chip = CHIPS.get(kind)
  for prefix, name in _PREFIXES:
    if chip is None and kind.startswith(prefix):
      chip = CHIPS[name]
  if chip is None or network is None:
    return chip
  return dataclasses.replace(chip, dcn_bandwidth=NETWORKS[network])   # MeshConfig checked the name
