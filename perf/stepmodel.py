"""How long will one training step take on hardware we do not have? A model of the step.

The input is the compiled step itself (for a TPU slice we have never rented, the
real TPU compiler's program via libtpu's topology description), the mesh it was
compiled for and the chip table (perf/hardware.py). The program is split into
the pieces its control flow runs: the entry computation and each loop body (a scan
over layers, pipeline iterations, microbatch accumulation), each with how many times
it runs per step and its own FLOPs, bytes and collectives (perf/costs.py:
priced by XLA's own cost analysis, loops counted by their trip counts). Then:

Assumptions
  1. Compute. Every op is priced by what it is (perf/ops.py `seconds`: kind and
     operand dtype -> the dtype's peak x the kind's efficiency on that chip family). What
     XLA compiles itself (fusions, dots: its cost analysis) runs at `matmul_efficiency`,
     the share of the datasheet peak that large bf16 matmuls reach (MXU/tensor core
     pipeline fill, operand movement HBM->VMEM/SMEM, layout copies): one number per chip
     family, not per model (hardware.py MATMUL_EFFICIENCY: 0.8 on TPU, 0.73 measured on an
     H100), divided on a TPU by what the program's dot shapes leave of its MXUs (padding to
     the chip's MXU side, 128 or 256: perf/mxu.py; 1 where every dim fills it). Library calls XLA counts as 0 FLOPs (cuBLAS GEMMs, cuDNN flash attention on
     GPUs) are priced from their operands at their own measured efficiency. Elementwise
     work is counted as FLOPs at the matmul rate: it is a few percent of a Transformer's
     FLOPs, and its memory traffic is in the next term.
  2. Memory. A piece's bytes accessed (logical, from XLA) that cross HBM (perf/hbm.py: not
     the TPU's on-chip buffers, an async copy once per HBM end, an async collective's buffer
     once; a TPU program standing in for a GPU keeps XLA's count) at the HBM bandwidth. Within
     a piece, compute and memory traffic overlap (fused matmuls stream their operands, and
     the TPU compiler prefetches the next fusions' operands under the current one's matmuls),
     so on a TPU a piece costs max(compute, memory), not the sum. A GPU runs one kernel at a
     time and a kernel's traffic overlaps only its own math: the traffic of kernels that run
     no matmul (perf/kernels.py: norms, activations, the optimizer update) adds to it,
     max(compute, the rest of memory) + that traffic.
  3. Collectives. Each collective's time comes from its bytes, its replica group and
     the links the group crosses (perf/links.py: TPU ICI torus dims with or
     without wraparound, TPU v3's shared chip links, DCN between slices, NVLink and the
     network between GPU hosts), plus a small fixed latency. Every byte is priced on the
     link it crosses: a group spanning granules (mesh.granule_of: TPU slices, GPU/CPU
     hosts) pays its ICI part and its DCN part (by_link shows both); a multi-slice TPU
     program's cross-slice part is not an HLO collective but a megascale host transfer
     (`send` with `_xla_megascale_transfer_type`), read by report.collectives with its
     slices and priced on DCN alone. Such a transfer is asynchronous (its send and recv
     have dones) and counts as overlapped (assumption 4) only where the schedule runs
     matmul work between the send and its done and between the recv and its done: a
     pipeline's stage shift under the next microbatch's layers, a weight gather under the
     layer before. Otherwise it is exposed: a gradient all-reduce at the end of the
     backward pass, a shift the stage body waits for. Priced as GPUs (a stand-in), every
     cross-slice transfer is exposed (`_overlaps`). One permute the runtime splits into
     sends of one buffer from disjoint slices (a cyclic shift) is one transfer.
  4. Overlap. Asynchronous collectives (`-start`/`-done` pairs the latency-hiding
     scheduler placed, or the TPU compiler's async collective fusions: report.collectives)
     overlap the compute of the piece they run in: in a scanned
     layer, the next layer's weight all-gather runs behind this layer's matmuls. They
     are hidden up to the piece's own compute time; the rest is exposed. So are the
     collective-permutes of the TPU compiler's windowed einsum loops (a matmul split
     into chunks so that each chunk's transfer runs under the previous chunk's
     matmul: that overlap is why the loop exists, even where the program writes the
     permute as one synchronous op, as on v3). Other synchronous collectives sit on
     the critical path. So a piece costs
        max(own time (assumption 2), async collectives) + sync collectives.
  4b. Host transfers. The layer inputs and projections an offload remat policy parks in host
     memory (perf/hbm.py `host_bytes`: dynamic-update-slices into and dynamic-slices out of
     host buffers, host copies) cross the chip's host link at `host_bandwidth`, beside the
     piece's work: a piece costs max(its time above, host transfers) + synchronous ones.
  5. Recompute is not a constant: rematerialized layers appear in the compiled program
     as extra FLOPs, and the ratio hardware FLOPs / model FLOPs says how much.
  6. Pipeline bubble: in shardax's pipeline (pipeline/), idle stages compute on
     padding during fill and drain, so the bubble's time is already in the loop's
     FLOPs; the breakdown names it: (S-1)/(M*R+S-1) of the loop time.
  7. Not modelled: host input pipeline, stragglers, ICI congestion between
     collectives that run at once, HBM contention of overlapped collectives, kernel
     launch gaps on GPUs, and compiler passes that differ between the libtpu version
     here and the one a real run uses.

step_seconds = sum over pieces of executions x cost(piece). MFU counts model FLOPs
(perf/flops.py: 6N + causal-halved attention, the PaLM/MaxText convention);
HFU counts the compiled program's FLOPs (recompute and padding included).

The roofline guard: no step is faster than the model FLOPs it trains at the chips' peak,
or than the HBM traffic it cannot avoid (`roofline`). A prediction under that bound means
a term above is wrong (a kernel the costs miss, a loop counted too few times), so
`from_costs` refuses it with `ImpossiblePrediction`, naming the terms, rather than report
an MFU at or above 100%.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from shardax.pipeline import schedule
from shardax.perf.hlo import groups as replica_groups
from shardax.perf import hardware
from shardax.perf import costs as costs_lib
from shardax.perf import flops as flops_lib
from shardax.perf import links
from shardax.perf import mxu as mxu_lib
from shardax.perf import ops


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted step time of one compiled step on one chip type, and what it is made of."""
  step_seconds: float
  mfu: float                          # model FLOPs / (devices x peak x step)
  hfu: float                          # compiled (hardware) FLOPs / (peak x step), per device
  tokens_per_second_per_device: float
  chip: str
  model_flops_per_step: float
  hardware_flops_per_device: float
  flops_convention: str
  breakdown: dict[str, Any]
  stand_in_for: str = ""              # the device kind the program was compiled for, when not `chip`

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


class ImpossiblePrediction(ValueError):
  """A predicted step under the roofline of what it trains (`roofline`): some term of the
  model is wrong. `prediction`: the refused Prediction; `roofline`: the bound it broke."""

  def __init__(self, prediction: "Prediction", bound: dict):
    self.prediction, self.roofline = prediction, bound
    super().__init__(
        f"step model: predicted step {prediction.step_seconds:.4g} s on {prediction.chip} is under the "
        f"roofline of what it trains, {bound['seconds']:.4g} s (model FLOPs time at peak "
        f"{bound['model_flops_seconds']:.4g} s: {bound['model_flops']:.4g} FLOPs over {bound['devices']} "
        f"devices at {bound['peak_flops'] / 1e12:,.0f} T/s; HBM floor {bound['hbm_floor_seconds']:.4g} s: "
        f"{bound['hbm_floor_bytes']:.4g} bytes per device at {bound['hbm_bandwidth'] / 1e9:,.0f} GB/s); "
        f"refused: a term of the step model under-counts this program (compute "
        f"{prediction.breakdown['compute_seconds']:.4g} s, memory {prediction.breakdown['memory_seconds']:.4g} s)")

  def as_dict(self) -> dict[str, Any]:
    return {"message": str(self), "step_seconds": self.prediction.step_seconds, "roofline": self.roofline}


def roofline(exp, num_devices: int, chip: hardware.Chip, state_bytes_per_device: float | None = None,
             dtypes: tuple[str, ...] = ("bf16",)) -> dict[str, Any]:
  """The least time any train step of `exp` can take on `num_devices` x `chip`.

  model_flops_seconds  the model's FLOPs per step (flops.py's convention: only what training
      needs, no recompute or padding) over all devices at the fastest peak among `dtypes`,
      the operand types of the program's dots (bf16, and int8/fp8 where it has 8-bit dots).
  hbm_floor_seconds  each device reads every byte of the training state it holds at least
      once a step (the forward pass, the optimizer) and writes it back once (the update):
      2 x state bytes per device at the HBM bandwidth. `state_bytes_per_device`: the exact
      parameters + optimizer state of the busiest device (the dry run reads them from the
      shardings); without it, the parameters alone (param_count x param dtype) spread evenly
      over the devices, the least any sharding leaves the busiest device.
  seconds  the larger of the two: compute and memory traffic can overlap, so not the sum.
  Known limit: model FLOPs count every routed MoE copy as processed, so an MoE whose capacity
  is below one fair share (capacity_factor < 1, none registered) could run under this bound.
  """
  model_flops = float(exp.model.flops_per_example(exp.data)) * exp.train.global_batch
  peak = max(ops.peak(chip, d) for d in dtypes)
  if state_bytes_per_device is None:
    count = getattr(exp.model, "param_count", None)
    width = 2 if getattr(exp.model, "param_dtype", "float32") == "bfloat16" else 4
    state_bytes_per_device = count() * width / num_devices if callable(count) else 0.0
  floor_bytes = 2.0 * state_bytes_per_device
  compute, memory = model_flops / (num_devices * peak), floor_bytes / chip.hbm_bandwidth
  return {"seconds": max(compute, memory), "model_flops_seconds": compute, "hbm_floor_seconds": memory,
          "model_flops": model_flops, "devices": num_devices, "peak_flops": peak,
          "hbm_floor_bytes": floor_bytes, "hbm_bandwidth": chip.hbm_bandwidth}


def checked(pr: "Prediction") -> "Prediction":
  """`pr`, or ImpossiblePrediction when its step is under its roofline (breakdown['roofline'])."""
  bound = pr.breakdown["roofline"]
  if pr.step_seconds < bound["seconds"] * (1 - 1e-9):
    raise ImpossiblePrediction(pr, bound)
  return pr


def runs_flash_kernel(hlo_text: str) -> bool:
  """Whether the program calls the Pallas splash-attention kernel, which XLA's costs price at
  0 FLOPs (its time is added by `with_flash_kernel`)."""
  return "tpu_custom_call" in hlo_text and "splash" in hlo_text


def predict(compiled, mesh, exp, chip: hardware.Chip | None = None) -> Prediction | None:
  """The step time of `compiled` (the train step of `exp` on `mesh`); None without a chip row.
  ImpossiblePrediction when it is under the roofline (`from_costs`)."""
  chip = chip or hardware.lookup(mesh.devices.flat[0].device_kind)
  if chip is None:
    return None
  cost = costs_lib.of_compiled(compiled)
  hlo = compiled.as_text()
  return from_costs(cost, mesh, exp, chip, mxu_lib.by_piece(hlo, cost.owner), flash_kernel=runs_flash_kernel(hlo))


def from_costs(costs: costs_lib.Costs, mesh, exp, chip: hardware.Chip, mxu: dict | None = None,
               flash_kernel: bool = False, state_bytes_per_device: float | None = None) -> Prediction:
  """`predict` from loop-aware costs already read from the program; `mxu`: each piece's dot
  utilization per MXU tile (perf/mxu.py `by_piece`), None where not read (taken as 1);
  `flash_kernel`: the program runs the Pallas flash kernel its costs miss (`with_flash_kernel`);
  `state_bytes_per_device`: parameters + optimizer state of one device, for the HBM floor.
  Raises ImpossiblePrediction when the step is under the roofline (`roofline`): never a figure
  faster than the model FLOPs at peak or the HBM floor."""
  n = int(mesh.size)
  comm = _collective_times(costs, mesh, chip)
  own = _own_times(costs, chip, mxu)
  spare = _spare_compute(costs, own, comm)
  pieces, totals = [], collections.Counter()
  eight_bit = collections.Counter()   # XLA's 8-bit dots (model.quantization): FLOPs by operand type
  for p, (use, compute, memory, alone) in zip(costs.pieces, own):
    for kind, dtype, f in p.ops:
      if kind == "xla":
        eight_bit[dtype] += p.executions * f
    totals["mxu_flops"] += p.executions * p.flops
    totals["mxu_spent"] += p.executions * p.flops / use
    local = _local(compute, memory, alone)
    async_t, sync_t = comm["async"].get(p.computation, 0.0), comm["sync"].get(p.computation, 0.0)
    spans = comm["spanning"].get(p.computation, {})
    span_t = sum(spans.values())
    async_t += span_t  # permutes around loops hide behind this piece and, beyond it, those loops
    budget = local + min(span_t, sum(spare.get(b, 0.0) for b in spans) / p.executions)
    hidden = min(async_t, budget)
    # host transfers (offloaded activations) run on the host link beside the piece's work
    host_t, host_sync = _host_seconds(p, chip)
    busy = local + async_t - hidden
    t = max(busy, host_t) + sync_t + host_sync
    for key, value in (("compute", compute), ("memory", memory), ("alone", alone), ("hidden", hidden),
                       ("exposed", async_t + sync_t - hidden), ("step", t), ("host", host_t + host_sync),
                       ("host_exposed", max(0.0, host_t - busy) + host_sync)):
      totals[key] += p.executions * value
    pieces.append({"computation": p.computation, "executions": p.executions,
                   "seconds_each": t, "compute_seconds_each": compute,
                   "memory_seconds_each": memory, "collective_seconds_each": async_t + sync_t})
  step = totals["step"]
  model_flops = float(exp.model.flops_per_example(exp.data)) * exp.train.global_batch
  tokens = exp.model.tokens_per_example(exp.data) * exp.train.global_batch
  bubble = _bubble_fraction(exp) * (step - (pieces[0]["seconds_each"] if pieces else 0.0))
  breakdown = {
      "compute_seconds": totals["compute"], "memory_seconds": totals["memory"],
      "matmul_free_seconds": totals["alone"],   # of memory, what a GPU's kernels without a matmul take alone
      "collectives": {"by_kind": dict(comm["by_kind"]), "by_axis": dict(comm["by_axis"]),
                      "by_link": dict(comm["by_link"]),
                      "exposed_seconds": totals["exposed"], "hidden_seconds": totals["hidden"]},
      "bubble_seconds": bubble,
      "host_transfer": {"seconds": totals["host"], "exposed_seconds": totals["host_exposed"],
                        "host_bandwidth": chip.host_bandwidth},
      "recompute_factor": recompute_factor(costs.flops, n, model_flops),
      "matmul_efficiency": chip.matmul_efficiency,
      "mxu_utilization": totals["mxu_flops"] / totals["mxu_spent"] if totals["mxu_spent"] else 1.0,
      "dcn_bandwidth": chip.dcn_bandwidth,
      "eight_bit_flops": {d: {"flops": f, "peak": ops.peak(chip, d)} for d, f in eight_bit.items()},
      "roofline": roofline(exp, n, chip, state_bytes_per_device, ("bf16", *(d for d, f in eight_bit.items() if f))),
      "pieces": pieces}
  pr = Prediction(
      step_seconds=step,
      mfu=model_flops / (n * chip.peak_bf16_flops * step) if step else 0.0,
      hfu=costs.flops / (chip.peak_bf16_flops * step) if step else 0.0,
      tokens_per_second_per_device=tokens / step / n if step else 0.0,
      chip=chip.name, model_flops_per_step=model_flops, hardware_flops_per_device=costs.flops,
      flops_convention=flops_lib.CONVENTION, breakdown=breakdown, stand_in_for=_stand_in(mesh, chip))
  return checked(with_flash_kernel(pr, exp, mesh, chip) if flash_kernel else pr)


def _stand_in(mesh, chip: hardware.Chip) -> str:
  """The compiled-for device kind when the program is priced as another chip (a TPU program
  timed as an H100: same partitioning, another compiler's fusion and scheduling), else ""."""
  devices = getattr(mesh, "devices", None)
  kind = getattr(devices.flat[0], "device_kind", "") if devices is not None else ""
  return kind if kind and hardware.lookup(kind) is not chip else ""


def _collective_times(costs: costs_lib.Costs, mesh, chip: hardware.Chip) -> dict[str, dict]:
  """Seconds of collectives per execution of each piece (async / sync), and per step by kind,
  mesh axis and link."""
  out = {k: collections.Counter() for k in ("async", "sync", "by_kind", "by_axis", "by_link")}
  out["spanning"] = collections.defaultdict(collections.Counter)  # piece -> loop bodies -> seconds
  routes: dict[str, links.Route] = {}
  riding = _mirrored(costs.collectives, mesh.size)
  for c in costs.collectives:
    if getattr(c, "link", "") == "dcn":  # a megascale send: the cross-slice part, on DCN only
      r = links.across_granules(c.span or 2)
    else:
      if c.replica_groups not in routes:
        group = links.first_group(c.replica_groups, mesh.size) if c.replica_groups else list(range(mesh.size))
        routes[c.replica_groups] = links.route(mesh.devices, tuple(mesh.axis_names), group)
      r = routes[c.replica_groups]
    parts = links.seconds_by_link(c.kind, c.bytes, r, chip)
    if c.name in riding and _ring_wraps(c, mesh, chip):  # the other direction of a mirrored ring: free
      parts = {link: 0.0 for link in parts}
    t = sum(parts.values())
    piece = costs.piece_of(c)
    owner = piece.computation if piece else (costs.pieces[0].computation if costs.pieces else "")
    if c.kind == "collective-permute" and c.loops_between:
      out["spanning"][owner][c.loops_between] += t
    else:
      out["async" if _overlaps(c, chip) else "sync"][owner] += t
    out["by_kind"][c.kind] += t * c.executions
    axis = "dcn (slices)" if getattr(c, "link", "") == "dcn" else "+".join(r.axes) or "none"
    out["by_axis"][axis] += t * c.executions
    for link, seconds in parts.items():
      if seconds:
        out["by_link"][link] += seconds * c.executions
  return out


def _ring_wraps(c, mesh, chip: hardware.Chip) -> bool:
  """Whether the ring a permute's pairs close lies on torus dims that wrap around: then each
  direction of every link carries one transfer. Without wraparound the ring's closing pair
  runs back along the line, over the links the mirrored ring uses, so the two contend."""
  step = dict(tuple(p) for p in replica_groups.groups(c.replica_groups, mesh.size))
  ring, node = [], next(iter(step), None)
  while node is not None and node not in ring:
    ring.append(node)
    node = step.get(node)
  if node != (ring[0] if ring else None) or len(ring) < 3:
    return False
  r = links.route(mesh.devices, tuple(mesh.axis_names), ring)
  # links.py: a dim wraps when the group spans all of it and it is long enough for the torus
  return r.dcn_size <= 1 and bool(r.dims) and all(full and size >= chip.wraparound_from
                                                   for size, full in r.dims)


def _mirrored(collectives, num_devices: int) -> set[str]:
  """Names of async permutes that run beside a permute of the same bytes in the same
  computation whose source-target pairs are theirs reversed (one of each such pair)."""
  permutes = {(c.computation, c.name): c for c in collectives
              if c.kind == "collective-permute" and c.is_async and c.concurrent_with}
  pairs = lambda c: frozenset(tuple(p) for p in replica_groups.groups(c.replica_groups, num_devices))
  riding = set()
  for (comp, name), c in permutes.items():
    for other in c.concurrent_with:
      d = permutes.get((comp, other))
      if d is not None and other < name and other not in riding and d.bytes == c.bytes \
          and pairs(d) == frozenset((b, a) for a, b in pairs(c)):
        riding.add(name)
        break
  return riding


def _overlaps(c, chip: hardware.Chip) -> bool:
  """Whether a collective can run under its piece's compute (assumption 4). A cross-slice
  transfer a TPU program standing in for GPUs overlaps (assumption 3) does not count as hidden
  there: on the TPU the runtime moves it from the host beside the TensorCores, which is what the
  compiler's overlap relies on; a GPU runs it as a NCCL kernel on its own SMs, which the stand-in
  says nothing about. Priced exposed, an upper bound (docs/scale.md: the A3 rows' step grows
  with the VM count as a ring all-reduce's bytes do, 2(n-1)/n)."""
  if getattr(c, "link", "") == "dcn" and ops.family(chip) != "tpu":
    return False
  if c.kind == "collective-permute" and "windowed_dot_general" in c.computation:
    return True
  if c.kind == "collective-permute":  # only what the schedule puts between start and done
    return c.is_async and c.compute_between > 0
  return c.is_async


def _host_seconds(p: costs_lib.Piece, chip: hardware.Chip) -> tuple[float, float]:
  """(async, sync) seconds of one execution of a piece's transfers between device and host memory
  (an offload remat policy's: perf/hbm.py `host_bytes`) on the chip's host link, one way at
  `host_bandwidth`. The async ones run beside the piece's compute, memory traffic and
  collectives (another link, another DMA queue): a piece lasts the longer of the two."""
  if not chip.host_bandwidth:
    return 0.0, 0.0
  return p.host_bytes / chip.host_bandwidth, p.host_sync_bytes / chip.host_bandwidth


def _own_seconds(p: costs_lib.Piece, chip: hardware.Chip, use: float = 1.0) -> tuple[float, float, float]:
  """(compute, memory, alone) seconds of one execution of a piece (assumptions 1 and 2); `use`:
  the share of the MXU its dots fill (perf/mxu.py); `alone`: of memory, what a GPU spends in
  kernels that run no matmul (perf/kernels.py), 0 on a TPU (its compiler prefetches one
  fusion's operands under another's matmuls)."""
  compute = ops.seconds("xla", "bf16", p.flops / use, chip) + sum(ops.seconds(*op, chip) for op in p.ops)
  if ops.family(chip) == "tpu":
    return compute, p.hbm_bytes / chip.hbm_bandwidth, 0.0
  # a TPU program timed as a GPU (a stand-in) keeps XLA's count: the GPU has no such on-chip buffers
  return compute, p.bytes_accessed / chip.hbm_bandwidth, p.matmul_free_bytes / chip.hbm_bandwidth


def _local(compute: float, memory: float, alone: float) -> float:
  """A piece's own time: its matmul kernels' compute and traffic overlap, max(compute, the rest
  of memory); the traffic of kernels that run alone (`alone`) adds to it."""
  return max(compute, memory - alone) + alone


def _own_times(costs: costs_lib.Costs, chip: hardware.Chip, mxu: dict | None) -> list[tuple[float, ...]]:
  """(MXU use, compute, memory, alone seconds: `_own_seconds`) of one execution of each piece, in
  `costs.pieces` order; `use`: its dots' share of the MXU tile (padding to the MXU side)."""
  out = []
  for p in costs.pieces:
    use = mxu_lib.piece_utilization(mxu, p.computation, chip.mxu_dim)
    out.append((use, *_own_seconds(p, chip, use)))
  return out


def _spare_compute(costs: costs_lib.Costs, own: list[tuple[float, ...]], comm: dict) -> dict[tuple, float]:
  """Per tuple of loop bodies that async permutes span: seconds per step of those loops'
  compute (every piece nested in them) left after hiding their own async collectives
  (`own`: `_own_times`)."""
  spare = {}
  for bodies in {b for spans in comm["spanning"].values() for b in spans}:
    seconds = 0.0
    for p, (_, compute, memory, alone) in zip(costs.pieces, own):
      if set(bodies) & set(p.loops):
        seconds += p.executions * max(0.0, _local(compute, memory, alone) - comm["async"].get(p.computation, 0.0))
    spare[bodies] = seconds
  return spare


def _bubble_fraction(exp) -> float:
  p = getattr(exp.model, "pipeline", None)
  if p is None or p.stages <= 1:
    return 0.0
  return schedule.bubble_fraction(p.stages, p.microbatches, p.circular_repeats, p.delay_shift)


def offload_seconds(host_bytes: int, compute_seconds: float, chip: hardware.Chip) -> dict[str, Any]:
  """The host transfers of an offload remat policy (layers/transformer.py 'offload*'), priced.

  `host_bytes`: the compiler's host temp bytes per device (memory_analysis), i.e. what the
  forward pass parks in host memory; each byte crosses the host link twice per step (out in
  the forward pass, back in the backward pass) at `chip.host_bandwidth`. The copies are
  asynchronous (copy-start/copy-done the scheduler overlaps with the layer's matmuls), so
  they hide when they take less than the step's compute; the rest is exposed. Not folded
  into `step_seconds`: the step prices the transfers the program itself runs, piece by
  piece (assumption 4b); this is the compiler's host memory, reported beside it."""
  if not host_bytes or not chip.host_bandwidth:
    return {"bytes": int(host_bytes or 0), "seconds": 0.0, "hidden": True, "exposed_seconds": 0.0}
  seconds = 2 * host_bytes / chip.host_bandwidth
  return {"bytes": int(host_bytes), "seconds": seconds, "host_bandwidth": chip.host_bandwidth,
          "hidden": seconds <= compute_seconds, "exposed_seconds": max(0.0, seconds - compute_seconds)}


def recompute_factor(hardware_flops_per_device: float, num_devices: int, model_flops_per_step: float):
  """The compiled program's FLOPs over the model's (assumption 5): > 1 by what is recomputed."""
  return hardware_flops_per_device * num_devices / model_flops_per_step if model_flops_per_step else None


def flash_kernel_seconds(exp, num_devices: int, chip: hardware.Chip) -> float:
  """Seconds per step of the Pallas flash-attention kernel (layers/flash.py) on one device.

  XLA's cost analysis prices a Pallas `tpu_custom_call` at 0 FLOPs, so the compiled program's
  costs miss the attention score matmuls the kernel does. Counted as the kernel runs them,
  the same way a GPU program's cuDNN flash calls are (ops.attention_flops): forward QK^T and
  PV, 4 S S D per head, halved for the causal mask (fully masked blocks are skipped); the
  backward recomputes the scores and does 5 matmuls (2.5 x the forward); a rematerialized
  layer runs the forward once more. Priced at the chip family's attention efficiency (TPU:
  the matmul rate; a GPU, for a TPU program standing in for a GPU one: the measured cuDNN
  flash rate), divided on a TPU by what the kernel's block shapes leave of the MXU
  (perf/mxu.py `flash_kernel_fill`: a 128-wide head fills half of a v6e 256 x 256 array in
  the matmuls that contract over it)."""
  fill = mxu_lib.flash_kernel_fill(exp, chip.mxu_dim)
  return ops.seconds("attention", "bf16", flash_kernel_flops(exp, num_devices) / fill, chip)


def flash_kernel_flops(exp, num_devices: int) -> float:
  """FLOPs per step and device of the flash kernel, as flash_kernel_seconds counts them."""
  t = exp.model
  seq = exp.data.seq_len
  forward = 2 * t.num_layers * seq * t.num_heads * flops_lib.score_width(t) / 2   # per token (MLA: its widths)
  per_token = forward * (3.5 + (1.0 if t.remat != "none" else 0.0))
  return per_token * seq * exp.train.global_batch / num_devices


def with_flash_kernel(pr: Prediction, exp, mesh, chip: hardware.Chip) -> Prediction:
  """`pr` for a program that runs the Pallas flash kernel, which its costs price at 0 FLOPs:
  the kernel's time (flash_kernel_seconds) added to the step, the ratios rescaled to match,
  and its FLOPs added to the hardware FLOPs (HFU, recompute factor): the chip runs them.
  Applied by `from_costs(flash_kernel=True)`, before the roofline check."""
  n = int(mesh.size)
  flops = flash_kernel_flops(exp, n)
  seconds = flash_kernel_seconds(exp, n, chip)
  step = pr.step_seconds
  scale = step / (step + seconds) if step + seconds else 0.0
  hw_flops = pr.hardware_flops_per_device + flops
  return dataclasses.replace(
      pr, step_seconds=step + seconds, mfu=pr.mfu * scale, hardware_flops_per_device=hw_flops,
      hfu=hw_flops / (chip.peak_bf16_flops * (step + seconds)) if step + seconds else 0.0,
      tokens_per_second_per_device=pr.tokens_per_second_per_device * scale,
      breakdown={**pr.breakdown, "flash_kernel_seconds": seconds,
                 "recompute_factor": recompute_factor(hw_flops, n, pr.model_flops_per_step)})
