"""Peak figures of accelerators, per jax device: the denominators of MFU, rooflines and the step model.

`CHIPS` holds one row per chip generation, keyed by jax's `device.device_kind`; `lookup` also
takes the other spellings jax reports. Every figure is per *jax device*: TPU v3 and TPU7x run
each of a chip's two TensorCores as its own device, so their rows are the vendor's per-chip
figures halved; TPU v4 and v5p run their two cores as one "megacore" device (per device = per
chip). Each row names, in `sources`, where each of its figures comes from: a vendor page, a
paper, or a derivation; a figure left at 0 says why (tests/test_hardware.py checks both).
`NETWORKS` are the data-center networks between GPU hosts that `mesh.network` can name.
Vector-unit throughput is not a field: the step model prices elementwise work at the matmul
rate and its memory traffic at the HBM rate (stepmodel.py), so no row needs it.

This module is a leaf: it imports nothing from shardax, so sharding/ may import it.
"""

from __future__ import annotations

import dataclasses

GiB = 1024**3
GB = 1000**3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One accelerator, per jax device. Every field is named in each row and sourced in `sources`."""
  name: str                   # jax's device_kind
  peak_bf16_flops: float      # dense bf16 matmul FLOP/s (no sparsity)
  hbm_bytes: int              # HBM capacity (the compiler may keep a little of it back)
  hbm_bandwidth: float        # HBM bytes/s
  ici_bandwidth: float        # chip-to-chip bytes/s, both directions together (TPU ICI, GPU NVLink):
                              # a rough roofline figure; the step model uses the per-link one below
  source: str                 # the row's datasheet page
  ici_link_bandwidth: float   # bytes/s one way over one ICI link; GPUs: one GPU's NVLink one way
                              # (NVSwitch: any peer at full rate)
  torus_dims: int             # dims of the slice's torus (TPU 2 or 3); 0: NVSwitch
  wraparound_from: int        # a slice dim of at least this many chips closes into a ring; smaller
                              # dims are open chains (half a ring's bandwidth). 0: never. 2D tori
                              # v5e/v6e wrap only full 16-chip rows; 3D tori from 4 (optical switches)
  dcn_bandwidth: float        # bytes/s one way per device over the data-center network between
                              # granules (TPU slices, GPU hosts: sharding/mesh.granule_of): the
                              # host's NICs shared by its devices, which all send at once
  devices_per_chip: int       # jax devices per chip (2: TPU v3 and TPU7x, each core a device)
  matmul_efficiency: float    # fraction of peak a large unpadded bf16 matmul reaches (stepmodel.py);
                              # what MXU padding costs is computed per dot (perf/mxu.py)
  host_bandwidth: float       # bytes/s one way between a device and its host's memory (offload)
  peak_int8_flops: float      # dense int8 OP/s; 0: no int8 units, an int8 dot runs at the bf16 rate
  peak_fp8_flops: float       # dense fp8 FLOP/s; 0: no fp8 units, likewise
  cores_per_chip: int         # TPU TensorCores; GPU SMs
  mxus_per_core: int          # TPU MXUs per core; GPU tensor cores per SM
  mxu_dim: int                # side of the mxu_dim x mxu_dim systolic array; GPUs 0 (nothing to pad to)
  clock_hz: float             # 0 where no source states it
  ici_links_per_chip: int     # TPU ICI ports (4 on 2D tori, 6 on 3D); GPUs 0
  sources: dict = dataclasses.field(compare=False, repr=False)   # field -> where its figure comes from

  def __post_init__(self):
    missing = [f for f in SOURCED_FIELDS if f not in self.sources]
    unknown = sorted(set(self.sources) - set(SOURCED_FIELDS))
    if missing or unknown:
      raise ValueError(f"chip {self.name!r}: sources lacks {missing} and names unknown fields {unknown}; "
                       f"give one source per field of SOURCED_FIELDS")


SOURCED_FIELDS = tuple(f.name for f in dataclasses.fields(Chip) if f.name not in ("name", "source", "sources"))


def _cite(*groups: dict[str, str]) -> dict[str, str]:
  """Field -> source from groups keyed by space-separated field names; a later group wins."""
  return {field: src for group in groups for fields, src in group.items() for field in fields.split()}


# What large bf16 matmuls reach of the datasheet peak: one figure per family, not per row.
# Each row cites where its family figure comes from; per-op efficiencies (attention) are in ops.py.
MATMUL_EFFICIENCY = {"tpu": 0.8, "gpu": 0.73}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Network:
  """A data-center network between GPU hosts: its bandwidth one way per GPU, a line rate (what
  NCCL reaches is ~80-90% of it on RoCE and InfiniBand)."""
  name: str
  dcn_bandwidth: float
  source: str


_GCE_GPUS = "https://cloud.google.com/compute/docs/gpus and GKE's GPUDirect-TCPX(O) guide"
_DGX = "NVIDIA DGX user guides"
NETWORK_ROWS: dict[str, Network] = {n.name: n for n in (
    Network(name="a3-high", dcn_bandwidth=4 * 200e9 / 8 / 8,
            source=_GCE_GPUS + " (A3 High: 4 x 200 Gbps GPUDirect-TCPX NICs per 8 GPUs)"),
    Network(name="a3-mega", dcn_bandwidth=200e9 / 8,
            source=_GCE_GPUS + " (A3 Mega: 8 x 200 Gbps GPUDirect-TCPXO NICs, one per GPU)"),
    Network(name="a3-ultra", dcn_bandwidth=400e9 / 8,
            source=_GCE_GPUS + " (A3 Ultra, H200: one 400 Gbps ConnectX-7 RoCE NIC per GPU)"),
    Network(name="a4", dcn_bandwidth=400e9 / 8,
            source=_GCE_GPUS + " (A4, B200: one 400 Gbps ConnectX-7 RoCE NIC per GPU)"),
    Network(name="infiniband-ndr", dcn_bandwidth=400e9 / 8,
            source=_DGX + " (DGX H100 / B200: one 400 Gb/s ConnectX-7 InfiniBand NDR port per GPU)"),
    Network(name="infiniband-hdr", dcn_bandwidth=200e9 / 8,
            source=_DGX + " (DGX A100: one 200 Gb/s InfiniBand HDR port per GPU)"),
)}
# bytes/s one way per GPU by network name: what `mesh.network` accepts and `lookup` applies.
NETWORKS: dict[str, float] = {name: n.dcn_bandwidth for name, n in NETWORK_ROWS.items()}

_TPU = "https://cloud.google.com/tpu/docs/"
_NV = "https://www.nvidia.com/en-us/data-center/"
_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/tpus ('How to scale your model', part 2)"
_ARCH = ("https://cloud.google.com/tpu/docs/system-architecture-tpu-vm ('an MXU is 256 x 256 (v6e) or "
         "128 x 128 (earlier versions) multiply-accumulators')")
_V3_PAPER = ("Jouppi et al., 'A Domain-Specific Supercomputer for Training Deep Neural Networks', "
             "CACM 63(7), 2020, https://doi.org/10.1145/3360307 (TPU v3: 2 TensorCores of 2 MXUs, 940 MHz)")
_V4_PAPER = ("Jouppi et al., 'TPU v4: An Optically Reconfigurable Supercomputer for Machine Learning', "
             "ISCA 2023, https://doi.org/10.1145/3579371.3589350 (2 TensorCores of 4 MXUs, 1050 MHz, 6 ICI links)")
_IRONWOOD = "Google's Ironwood announcement (April 2025)"
_A100_WP = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper (https://images.nvidia.com/aem-dam/en-zz/"
            "Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf): 108 SMs, 4 tensor cores, 1410 MHz")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper (https://resources.nvidia.com/"
            "en-us-tensor-core): 132 SMs (SXM5), 114 (PCIe), 4 tensor cores per SM")
_UNREAD = "not published on the pages read (left 0: nothing uses it)"
_NO_INT8, _NO_FP8 = "no int8 units listed: priced at bf16 (0)", "no fp8 units listed: priced at bf16 (0)"

# Sources every TPU row shares. Host link: "PCIe bandwidth ~1.5e10 bytes/s" per chip.
_TPU_SOURCES = {
    "devices_per_chip": "libtpu's topology description (tests/test_hardware.py)",
    "host_bandwidth": _SCALING_BOOK,
    "matmul_efficiency": ("docs/scale.md 'Checked against published runs' (0.8: large unpadded matmuls, "
                          "set before the published rows were compared)")}
_TPU_HOST_BANDWIDTH = 1.5e10   # bytes/s one way between a chip and its host ("PCIe bandwidth ~1.5e10")


def _tpu(name: str, page: str, *, devices_per_chip: int, sources: dict[str, str], **figures) -> Chip:
  """A TPU row. `figures` are per jax device; `page` is the generation's Cloud TPU page, the
  source of its peaks, HBM and ICI figures and (with the scaling book) of its torus shape unless
  `sources` (keyed like `_cite`'s groups) names another; every TPU row shares the host link
  (per chip, split between its devices), the MXU side's architecture page and the family's
  matmul efficiency."""
  own = _TPU + page
  return Chip(name=name, source=own, devices_per_chip=devices_per_chip,
              host_bandwidth=_TPU_HOST_BANDWIDTH / devices_per_chip, matmul_efficiency=MATMUL_EFFICIENCY["tpu"],
              sources=_cite(_TPU_SOURCES, {
                  "peak_bf16_flops peak_int8_flops peak_fp8_flops hbm_bytes hbm_bandwidth ici_bandwidth": own,
                  "torus_dims wraparound_from": own + " / " + _SCALING_BOOK, "mxu_dim": _ARCH}, sources),
              **figures)


def _lite(name: str, page: str, *, sources: dict[str, str], **figures) -> Chip:
  """A "lite" TPU row (v5e, v6e): what the generation shares, from its page: one TensorCore and
  one jax device a chip, 4 ICI ports on a 2D torus that wraps from 16 chips a side, no fp8 and an
  unpublished clock; `figures` and `sources` are the chip's own."""
  return _tpu(name, page, devices_per_chip=1, peak_fp8_flops=0.0, ici_links_per_chip=4, torus_dims=2,
              wraparound_from=16, cores_per_chip=1, clock_hz=0.0,
              sources={"peak_fp8_flops": _NO_FP8, "clock_hz": _UNREAD,
                       "cores_per_chip": _TPU + f"{page} ('each {page} chip contains one TensorCore')",
                       "ici_links_per_chip": _TPU + f"{page} ('ICI ports per chip: 4')", **sources},
              **figures)

# Sources every GPU row shares: NVSwitch, no torus, no array to pad to, A3 High's network.
_GPU_SOURCES = {
    "torus_dims": "n/a: NVSwitch (0)", "wraparound_from": "n/a (0)", "devices_per_chip": "one GPU, one device",
    "dcn_bandwidth": ("https://cloud.google.com/compute/docs/gpus (A3 High: 4 x 200 Gbps NICs per 8 GPUs; "
                      "NETWORKS for others)"),
    "matmul_efficiency": "docs/performance.md 'On one H100 GPU' (0.73, measured on lm.1b)",
    "mxu_dim": "n/a: GPU tensor cores take small fragments and the GEMM kernel picks its tiles; no array pads",
    "ici_links_per_chip": "n/a: NVLink through NVSwitch, any peer at full rate (ici_link_bandwidth)"}
# What every GPU row shares: NVSwitch (no torus, no ICI ports), one device per GPU, no array to pad
# to, A3 High's network unless `mesh.network` names another.
_GPU = dict(torus_dims=0, wraparound_from=0, ici_links_per_chip=0, devices_per_chip=1, mxu_dim=0,
            dcn_bandwidth=NETWORKS["a3-high"], matmul_efficiency=MATMUL_EFFICIENCY["gpu"])


def _gpu_sources(page: str, matrix: str, **more: str) -> dict[str, str]:
  """A GPU row's sources: its datasheet page for its own figures (NVLink one way is half the page's
  bidirectional figure; the host link is its PCIe generation x16 one way), `matrix` for SMs and
  tensor cores, `more` (field names) for the rest."""
  return _cite(_GPU_SOURCES, {
      "peak_bf16_flops peak_int8_flops peak_fp8_flops hbm_bytes hbm_bandwidth ici_bandwidth": page,
      "ici_link_bandwidth": page + " (NVLink, one way = half the bidirectional figure)",
      "host_bandwidth": page + " (PCIe generation x16, one way)",
      "cores_per_chip mxus_per_core clock_hz": matrix}, more)


_A100 = dict(  # the A100 parts differ in HBM only; PCIe Gen4 x16 to the host
    peak_bf16_flops=312e12, peak_int8_flops=624e12, peak_fp8_flops=0.0, ici_bandwidth=600 * GB,
    ici_link_bandwidth=600 * GB / 2, host_bandwidth=32 * GB, cores_per_chip=108, mxus_per_core=4,
    clock_hz=1410e6, source=_NV + "a100/", sources=_gpu_sources(_NV + "a100/", _A100_WP, peak_fp8_flops=_NO_FP8))
_H100_SOURCES = _gpu_sources(_NV + "h100/", _H100_WP, clock_hz=_UNREAD + " (boost clocks differ by SKU)")

CHIPS: dict[str, Chip] = {c.name: c for c in (
    _tpu("TPU v3", "v3", devices_per_chip=2,   # per core: 123 TFLOPs, 32 GiB, 900 GBps per chip of 2
         peak_bf16_flops=123e12 / 2, peak_int8_flops=0.0, peak_fp8_flops=0.0,
         hbm_bytes=16 * GiB, hbm_bandwidth=900 * GB / 2,
         ici_bandwidth=2 * 340e12 / 1024 / 2,   # 2 x pod all-reduce 340 TB/s / 1024 chips, per core
         ici_link_bandwidth=1e11, ici_links_per_chip=4, torus_dims=2, wraparound_from=4, dcn_bandwidth=3.125e9,
         cores_per_chip=2, mxus_per_core=2, mxu_dim=128, clock_hz=940e6,
         sources={"ici_link_bandwidth dcn_bandwidth": _TPU + "v3 / " + _SCALING_BOOK,
                  "host_bandwidth": _SCALING_BOOK + " (the chip's link, shared by its two cores)",
                  "peak_int8_flops": _NO_INT8, "peak_fp8_flops": _NO_FP8,
                  "cores_per_chip mxus_per_core clock_hz": _V3_PAPER,
                  "ici_links_per_chip": _TPU + "v3 (2D torus, 4 ports)"}),
    _tpu("TPU v4", "v4", devices_per_chip=1,
         peak_bf16_flops=275e12, peak_int8_flops=275e12, peak_fp8_flops=0.0,
         hbm_bytes=32 * GiB, hbm_bandwidth=1200 * GB,
         ici_bandwidth=2 * 1.1e15 / 4096,   # 2 x pod all-reduce 1.1 PB/s / 4096 chips
         ici_link_bandwidth=4.5e10, ici_links_per_chip=6, torus_dims=3, wraparound_from=4, dcn_bandwidth=6.25e9,
         cores_per_chip=2, mxus_per_core=4, mxu_dim=128, clock_hz=1050e6,
         sources={"ici_link_bandwidth dcn_bandwidth": _TPU + "v4 / " + _SCALING_BOOK, "peak_fp8_flops": _NO_FP8,
                  "cores_per_chip mxus_per_core clock_hz ici_links_per_chip": _V4_PAPER}),
    _lite("TPU v5 lite", "v5e", peak_bf16_flops=197e12, peak_int8_flops=393e12,
          hbm_bytes=16 * GiB, hbm_bandwidth=819 * GB, ici_bandwidth=400 * GB, ici_link_bandwidth=5e10,
          dcn_bandwidth=3.125e9, mxus_per_core=4, mxu_dim=128,
          sources={"ici_link_bandwidth": _TPU + "v5e (400 GBps bidirectional ICI over 4 ports)",
                   "dcn_bandwidth": _TPU + "v5e (2 x 100 Gbps NICs per host of 8 chips)",
                   "mxus_per_core": _TPU + "v5e ('four matrix-multiply units')"}),
    # The v5p page says 95 GiB of HBM, but libtpu's compiler lets one device use 95.74 GiB.
    _tpu("TPU v5", "v5p", devices_per_chip=1,
         peak_bf16_flops=459e12, peak_int8_flops=918e12, peak_fp8_flops=0.0,
         hbm_bytes=96 * GiB, hbm_bandwidth=2765 * GB,
         ici_bandwidth=1200 * GB, ici_link_bandwidth=9e10, ici_links_per_chip=6, torus_dims=3, wraparound_from=4,
         dcn_bandwidth=6.25e9, cores_per_chip=2, mxus_per_core=4, mxu_dim=128, clock_hz=0.0,
         sources={"hbm_bytes": _TPU + "v5p (95 GiB) and libtpu, which lets one device use 95.74 GiB "
                               "(tests/test_hardware.py): 96 GiB",
                  "ici_link_bandwidth": _TPU + "v5p / " + _SCALING_BOOK,
                  "dcn_bandwidth": _TPU + "v5p (DCN 50 Gbps per chip)",
                  "peak_fp8_flops": _NO_FP8, "clock_hz": _UNREAD,
                  "cores_per_chip": _TPU + "v5p (the topology table: 8 cores per 4 chips)",
                  "mxus_per_core": _TPU + "v5p ('each TensorCore has four MXUs')",
                  "ici_links_per_chip": _TPU + "v5p (3D torus: 6 neighbours)"}),
    _lite("TPU v6 lite", "v6e", peak_bf16_flops=918e12, peak_int8_flops=1836e12,   # Trillium
          hbm_bytes=32 * GiB, hbm_bandwidth=1638 * GB, ici_bandwidth=800 * GB, ici_link_bandwidth=1e11,
          dcn_bandwidth=1.25e10, mxus_per_core=2, mxu_dim=256,
          sources={"ici_link_bandwidth": _TPU + "v6e (800 GBps bidirectional ICI over 4 ports)",
                   "dcn_bandwidth": _SCALING_BOOK + " (DCN per chip; the v6e page gives no NIC figure)",
                   "mxus_per_core": _TPU + "v6e ('two 256x256 matrix-multiply units')",
                   "mxu_dim": _TPU + "v6e ('256x256 matrix-multiply units')"}),
    # Ironwood, per device = half a chip: 2307 TFLOPs bf16, 4614 fp8, 192 GiB, 7.37 TB/s HBM, 1.2 TB/s ICI.
    _tpu("TPU7x", "tpu7x", devices_per_chip=2,
         peak_bf16_flops=2307e12 / 2, peak_int8_flops=0.0, peak_fp8_flops=4614e12 / 2,
         hbm_bytes=192 * GiB // 2, hbm_bandwidth=7370 * GB / 2,
         ici_bandwidth=1200 * GB / 2, ici_link_bandwidth=1e11, ici_links_per_chip=6, torus_dims=3, wraparound_from=4,
         dcn_bandwidth=6.25e9, cores_per_chip=2, mxus_per_core=0, mxu_dim=0, clock_hz=0.0,
         sources={"hbm_bandwidth": _IRONWOOD + " (7.37 TB/s per chip)",
                  "ici_bandwidth": _IRONWOOD + " (1.2 TB/s bidirectional per chip)",
                  "ici_link_bandwidth": _IRONWOOD + " (1.2 TB/s bidirectional ICI over 6 ports)",
                  "dcn_bandwidth": "not found on the pages read: v5p's 50 Gbps per chip",
                  "host_bandwidth": _SCALING_BOOK + " (the chip's link, shared by its two devices)",
                  "peak_int8_flops": "no int8 figure on the tpu7x page: priced at bf16 (0)",
                  "cores_per_chip": _TPU + "tpu7x (two TensorCores, each a jax device)",
                  "mxus_per_core clock_hz": _UNREAD, "mxu_dim": _UNREAD + "; no padding priced",
                  "ici_links_per_chip": _TPU + "tpu7x (3D torus: 6 neighbours)"}),
    Chip(name="NVIDIA A100-SXM4-80GB", hbm_bytes=80 * GiB, hbm_bandwidth=2039 * GB, **_A100, **_GPU),
    Chip(name="NVIDIA A100-SXM4-40GB", hbm_bytes=40 * GiB, hbm_bandwidth=1555 * GB, **_A100, **_GPU),
    Chip(name="NVIDIA A100 80GB PCIe", hbm_bytes=80 * GiB, hbm_bandwidth=1935 * GB, **_A100, **_GPU),
    Chip(name="NVIDIA A100-PCIE-40GB", hbm_bytes=40 * GiB, hbm_bandwidth=1555 * GB, **_A100, **_GPU),
    # H100 and H200: PCIe Gen5 x16 to the host; 8-bit peaks dense (twice that with sparsity).
    Chip(name="NVIDIA H100 80GB HBM3", source=_NV + "h100/", **_GPU,
         peak_bf16_flops=989e12, peak_int8_flops=1979e12, peak_fp8_flops=1979e12,
         hbm_bytes=80 * GiB, hbm_bandwidth=3350 * GB, ici_bandwidth=900 * GB, ici_link_bandwidth=900 * GB / 2,
         host_bandwidth=64 * GB, cores_per_chip=132, mxus_per_core=4, clock_hz=0.0, sources=_H100_SOURCES),
    Chip(name="NVIDIA H100 PCIe", source=_NV + "h100/", **_GPU,
         peak_bf16_flops=756e12, peak_int8_flops=1513e12, peak_fp8_flops=1513e12,
         hbm_bytes=80 * GiB, hbm_bandwidth=2000 * GB, ici_bandwidth=600 * GB, ici_link_bandwidth=600 * GB / 2,
         host_bandwidth=64 * GB, cores_per_chip=114, mxus_per_core=4, clock_hz=0.0, sources=_H100_SOURCES),
    Chip(name="NVIDIA H100 NVL", source=_NV + "h100/", **_GPU,
         peak_bf16_flops=835e12, peak_int8_flops=1671e12, peak_fp8_flops=1671e12,
         hbm_bytes=94 * GiB, hbm_bandwidth=3900 * GB, ici_bandwidth=600 * GB, ici_link_bandwidth=600 * GB / 2,
         host_bandwidth=64 * GB, cores_per_chip=132, mxus_per_core=4, clock_hz=0.0, sources=_H100_SOURCES),
    Chip(name="NVIDIA H200", source=_NV + "h200/", **_GPU,
         peak_bf16_flops=989e12, peak_int8_flops=1979e12, peak_fp8_flops=1979e12,
         hbm_bytes=141 * GiB, hbm_bandwidth=4800 * GB, ici_bandwidth=900 * GB, ici_link_bandwidth=900 * GB / 2,
         host_bandwidth=64 * GB, cores_per_chip=132, mxus_per_core=4, clock_hz=0.0,
         sources=_gpu_sources(_NV + "h200/", _H100_WP, clock_hz=_UNREAD + " (boost clocks differ by SKU)")),
    # HGX B200 page: 36 PFLOPs bf16 and 72 PFLOPs fp8 with sparsity for 8 GPUs, 62 TB/s HBM for 8.
    Chip(name="NVIDIA B200", source=_NV + "hgx/", **_GPU,
         peak_bf16_flops=2250e12, peak_int8_flops=4500e12, peak_fp8_flops=4500e12,
         hbm_bytes=180 * GiB, hbm_bandwidth=7700 * GB, ici_bandwidth=1800 * GB, ici_link_bandwidth=1800 * GB / 2,
         host_bandwidth=64 * GB, cores_per_chip=0, mxus_per_core=0, clock_hz=0.0,
         sources=_gpu_sources(_NV + "hgx/", _UNREAD, clock_hz=_UNREAD + " (boost clocks differ by SKU)")),
)}

# Other spellings jax reports for the same parts (driver and form-factor variants), first match wins.
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
