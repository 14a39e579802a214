"""The throughput benchmark (`--mode=benchmark`): step time, tokens/s, model FLOP/s, MFU.

Method, in order:
  1. build the sharded state and compile the train step ahead of time (`compile_s`);
  2. take `RING` batches from the experiment's own input pipeline (`data.source`)
     onto the devices and cycle through them, so host-side input time is not in
     the step time: this measures the step, not the data loader;
  3. run `train.benchmark_warmup` untimed steps;
  4. run `train.benchmark_steps` timed steps, each ended by `jax.block_until_ready`
     on the new state and metrics (device synchronized per step), under
     `jax.transfer_guard("disallow")` (proof that the step makes no host transfer);
     `state_donated` records that the first step consumed its input state's buffers;
  5. evaluate the final params once (the MLPerf log's `eval_accuracy`).

Definitions (the same ones the training loop logs):
  model_flops_per_step = exp.model.flops_per_example(exp.data) * train.global_batch
                         (perf/flops.py: 6 x matmul params + causal attention, PaLM
                         appendix B; rematerialized recomputation is not counted)
  tokens_per_s         = global_batch x tokens_per_example / median step time
  tflops_per_device    = model_flops_per_step / median step time / device_count / 1e12
  mfu                  = tflops_per_device / peak_tflops_per_device
  hardware_flops_per_device = FLOPs of the compiled step, loop bodies x trip counts
                         (perf/costs.py): recompute and padding included
  hfu                  = hardware_flops_per_device / median step time / peak (beside mfu)

Peak FLOP/s per device: TPUs and GPUs take the dense bf16 peak from the chip table
(`perf/hardware.py`, each entry with its source), whatever the model dtype, as MaxText
and the PaLM paper do. A CPU has no datasheet peak that XLA can reach, so it is
measured in the same process by a matmul probe (`MatmulProbe`): a jitted n x n matmul in
the model's compute dtype, sampled 5 times after the warm-up and once after every timed
step; each sample is FLOPs per CPU second of this process times its cores (the matmul's
rate with the machine to itself, which neighbours on a shared machine do not move),
the peak is the best sample, and the report gives the number of samples, the best, the
median and how far the median lies below the best (the probe's spread). On a CPU the
report adds `mfu_cpu_time`: model FLOPs per CPU second of the step over the probe's. One CPU device's matmul already uses every host core,
so the probe's rate is the host's and is split evenly over the (simulated) CPU devices.
CPU MFU therefore means "share of this CPU's best matmul rate".
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mlperf_logging.mllog import constants as C

from shardax.configs.schema import Experiment
from shardax.sharding import report, use_rules
from shardax.trainer.data import inputs
from shardax.trainer import jobdir
from shardax.perf import costs, mlperf
from shardax.perf.flops import CONVENTION
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib

RING = 4            # distinct device-resident batches the timed steps cycle through
PROBE_SIZE = 2048   # n of the CPU matmul probe (large enough to be compute bound)
PROBE_REPEATS = 5

KEYS = ("exp", "data_source", "device_kind", "platform", "device_count", "mesh", "dtype",
        "attention", "remat", "global_batch", "seq_len", "params", "warmup_steps", "steps",
        "compile_s", "step_time_s_median", "step_time_s_p10", "step_time_s_p90",
        "step_time_s_mean", "tokens_per_step", "tokens_per_s", "model_flops_per_step",
        "tflops_per_device", "peak_tflops_per_device", "peak_source", "mfu", "eval_loss",
        "state_donated", "flops_convention", "hardware_flops_per_device", "hfu")


class MatmulProbe:
  """The CPU's peak FLOP/s, measured: a jitted [n, n] @ [n, n] matmul in the model's compute
  dtype, sampled between the timed steps (same process, device and thread pool as the step).

  Each sample records the FLOPs per wall second and per CPU second of this process
  (`time.process_time`, all threads). On a machine shared with other jobs the wall rate
  follows the neighbours (best of 15 samples read 15-29 GFLOP/s in three runs at load
  15-20), the CPU-second rate does not (95.5-96.5 GFLOP/s per core-second at load 23).
  So the peak is the best FLOPs per CPU second times the cores this process may use:
  the rate of the matmul with the machine to itself, stable run to run."""

  def __init__(self, dtype: str = "float32", n: int = PROBE_SIZE, device: jax.Device | None = None):
    self.n = n
    self.dtype = dtype
    self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    device = device or jax.devices()[0]
    k1, k2 = jax.random.split(jax.random.key(0))
    self._a = jax.device_put(jax.random.normal(k1, (n, n), jnp.dtype(dtype)), device)
    self._b = jax.device_put(jax.random.normal(k2, (n, n), jnp.dtype(dtype)), device)
    self._mesh = jax.sharding.Mesh(np.array([device]), ("probe",))  # not the step's mesh
    self._mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.dtype(dtype)))
    self.samples: list[float] = []       # FLOPs per CPU second x cores
    self.wall_samples: list[float] = []  # FLOPs per wall second
    with jax.set_mesh(self._mesh):
      self._mm(self._a, self._b).block_until_ready()   # compile outside the samples

  def sample(self, repeats: int = 1) -> float:
    """Time `repeats` matmuls; record each; return the last (FLOP/s, CPU-time based)."""
    flops = 2.0 * self.n ** 3
    with jax.set_mesh(self._mesh):
      for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        self._mm(self._a, self._b).block_until_ready()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.wall_samples.append(flops / wall)
        self.samples.append(flops / max(cpu, 1e-9) * self.cores)
    return self.samples[-1]

  @property
  def best(self) -> float:
    return max(self.samples)

  def summary(self) -> dict[str, Any]:
    s = np.asarray(self.samples)
    return {"probe_samples": len(s), "probe_cores": self.cores, "probe_best_flops": float(s.max()),
            "probe_median_flops": float(np.median(s)), "probe_spread": float(1 - np.median(s) / s.max()),
            "probe_best_wall_flops": float(max(self.wall_samples))}


def matmul_probe_flops(dtype: str = "float32", n: int = PROBE_SIZE, repeats: int = PROBE_REPEATS,
                       device: jax.Device | None = None) -> float:
  """FLOP/s of the best of `repeats` jitted [n, n] @ [n, n] matmuls on `device`."""
  probe = MatmulProbe(dtype, n, device)
  probe.sample(repeats)
  return probe.best


def chip_peak(dev) -> tuple[float, str] | None:
  """(published dense bf16 peak FLOP/s, source) of an accelerator in the chip table, or None."""
  if dev.platform == "cpu":
    return None
  from shardax.perf import hardware
  chip = hardware.lookup(dev.device_kind)
  if chip is None:
    return None
  return float(chip.peak_bf16_flops), f"chip table: {chip.name} bf16 dense peak ({chip.source})"


def peak_flops_per_device(devices: list[jax.Device], dtype: str,
                          probe: MatmulProbe | None = None) -> tuple[float, str]:
  """(peak FLOP/s of one device, where the figure comes from). A CPU or an accelerator
  missing from the chip table is measured: by `probe`'s best sample when given (the
  benchmark samples it between its steps), else by a fresh best-of-5."""
  dev = devices[0]
  if (known := chip_peak(dev)) is not None:
    return known
  best = probe.best if probe is not None and probe.samples else matmul_probe_flops(dtype, device=dev)
  n = len(probe.samples) if probe is not None and probe.samples else PROBE_REPEATS
  if dev.platform != "cpu":
    return best, f"measured: best of {n} {dtype} matmul probes ({dev.device_kind!r} is not in the chip table)"
  cpu_devices = [d for d in jax.local_devices() if d.platform == "cpu"]
  cores = probe.cores if probe is not None else len(os.sched_getaffinity(0))
  return (best / len(cpu_devices),
          f"measured: best of {n} {dtype} {PROBE_SIZE}x{PROBE_SIZE} matmuls, FLOPs per CPU second x "
          f"{cores} cores ({best / 1e9:.1f} GFLOP/s) / {len(cpu_devices)} CPU devices")


def cpu_time_mfu(cpu_times: list[float], flops_per_step: float, probe: MatmulProbe | None) -> dict:
  """On a CPU, MFU in CPU seconds as well: model FLOPs per CPU second of the step over the
  probe's best FLOPs per CPU second. Neighbours on a shared machine stretch the wall
  clock of both the step and the probe, not their CPU seconds."""
  if probe is None or not cpu_times:
    return {}
  step_cpu = float(np.median(cpu_times))
  return {"step_cpu_s_median": step_cpu,
          "mfu_cpu_time": flops_per_step / step_cpu / (probe.best / probe.cores)}


def summarize(step_times: list[float], *, tokens_per_step: int, flops_per_step: float,
              device_count: int, peak_per_device: float) -> dict[str, float]:
  """Step-time percentiles and the rates derived from the median step."""
  t = np.asarray(step_times, np.float64)
  median = float(np.median(t))
  tflops = flops_per_step / median / device_count / 1e12
  return {"step_time_s_median": median, "step_time_s_p10": float(np.percentile(t, 10)),
          "step_time_s_p90": float(np.percentile(t, 90)), "step_time_s_mean": float(t.mean()),
          "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / median,
          "model_flops_per_step": flops_per_step, "tflops_per_device": tflops,
          "peak_tflops_per_device": peak_per_device / 1e12, "mfu": tflops * 1e12 / peak_per_device}


def _trace(exp: Experiment, i: int, job_dir: str, tracing: bool) -> bool:
  """Before timed step i (1-based): start a jax profiler trace at `profile_steps[0]`,
  stop it after `profile_steps[1]` (or at the end); returns whether a trace is on."""
  if len(exp.train.profile_steps) != 2:
    return False
  first, last = exp.train.profile_steps
  if not tracing and i == first and i <= exp.train.benchmark_steps:
    jobdir.start_trace(jobdir.path(job_dir) / "profile")
    return True
  if tracing and (i > last or i > exp.train.benchmark_steps):
    jobdir.stop_trace()
    return False
  return tracing


def run(exp: Experiment, job_dir: str) -> dict[str, Any]:
  """Benchmark `exp`'s train step; writes benchmark.json and mllog.txt to `job_dir`."""
  t = exp.train
  log, setup = mlperf.start_run(exp, job_dir)
  mesh = setup.mesh
  with jax.set_mesh(mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    state = state_lib.init_fn(setup)(jax.random.key(t.seed))
    t0 = time.perf_counter()
    train_step = step_lib.compile_train_step(setup)
    compile_s = time.perf_counter() - t0
    source = inputs.Batches(exp.data, "train", t.global_batch, setup.batch_sharding,
                            seed=exp.data.seed, vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))
    ring = [next(source) for _ in range(RING)]
    first_leaves = jax.tree.leaves(state)
    devices = list(mesh.devices.flat)
    probe = None if chip_peak(devices[0]) else MatmulProbe(exp.model.dtype, device=devices[0])
    for i in range(t.benchmark_warmup):
      state, _ = train_step(state, ring[i % RING])
    jax.block_until_ready(state)
    if probe:
      probe.sample(PROBE_REPEATS)
    log.end(C.INIT_STOP)
    log.start(C.RUN_START)
    log.start(C.BLOCK_START, samples_count=0, first_epoch_num=0, epoch_count=1)
    log.start(C.EPOCH_START, epoch_num=0, samples_count=0)
    times, cpu_times, tracing = [], [], False
    for i in range(t.benchmark_steps):
      tracing = _trace(exp, i + 1, job_dir, tracing)
      t0, c0 = time.perf_counter(), time.process_time()
      with jax.transfer_guard("disallow"):  # the step itself never moves data to or from the host
        state, metrics = train_step(state, ring[i % RING])
        jax.block_until_ready((state, metrics))
      times.append(time.perf_counter() - t0)
      cpu_times.append(time.process_time() - c0)
      if probe:  # between the timed steps: the same load the steps saw
        probe.sample()
    donated = all(a.is_deleted() for a in first_leaves)  # the first step reused the state's buffers
    _trace(exp, t.benchmark_steps + 1, job_dir, tracing)
    samples = t.benchmark_steps * t.global_batch
    log.end(C.EPOCH_STOP, epoch_num=0, samples_count=samples)
    log.end(C.BLOCK_STOP, first_epoch_num=0, samples_count=samples)
    log.start(C.EVAL_START, epoch_num=0, samples_count=samples)
    eval_step = step_lib.eval_step_fn(setup)
    eval_batches = inputs.eval_batches(exp.data, t.global_batch, t.eval_batches,
                                       setup.batch_sharding, vocab_size=getattr(exp.model, "vocab_size", inputs.BYTE_VOCAB))
    eval_loss = float(np.mean(jax.device_get([eval_step(state["params"], b) for b in eval_batches])))
    log.event(C.EVAL_ACCURACY, eval_loss, epoch_num=0, samples_count=samples,
              metric="eval_loss", lower_is_better=True)
    log.end(C.EVAL_STOP, epoch_num=0, samples_count=samples)
    log.end(C.RUN_STOP, status=C.SUCCESS, samples_count=samples)
  log.close()

  peak, peak_source = peak_flops_per_device(devices, exp.model.dtype, probe)
  result = {"exp": exp.name, "data_source": exp.data.source, "device_kind": devices[0].device_kind,
            "platform": devices[0].platform, "device_count": len(devices),
            "mesh": dict(mesh.shape), "dtype": exp.model.dtype,
            "attention": getattr(exp.model, "attention", None), "remat": getattr(exp.model, "remat", None),
            "global_batch": t.global_batch, "seq_len": exp.data.seq_len,
            "params": state_lib.count_params(setup), "warmup_steps": t.benchmark_warmup,
            "steps": t.benchmark_steps, "compile_s": compile_s,
            **summarize(times, tokens_per_step=t.global_batch * exp.model.tokens_per_example(exp.data),
                        flops_per_step=exp.model.flops_per_example(exp.data) * t.global_batch,
                        device_count=len(devices), peak_per_device=peak),
            "peak_source": peak_source, **(probe.summary() if probe else {}),
            **cpu_time_mfu(cpu_times, exp.model.flops_per_example(exp.data) * t.global_batch, probe),
            "eval_loss": eval_loss, "state_donated": donated, "step_times_s": times}
  result.update(flops_convention=CONVENTION, **device_memory(train_step))
  if devices[0].platform != "gpu":  # XLA's cost model prices no cuBLAS / cuDNN custom call
    hw_flops = costs.of_compiled(train_step).flops
    result.update(hardware_flops_per_device=hw_flops, hfu=hw_flops / result["step_time_s_median"] / peak)
  if jax.process_index() == 0:
    jobdir.write_text(jobdir.path(job_dir) / "benchmark.json", json.dumps(result, indent=2))
  return result


def device_memory(compiled) -> dict[str, float]:
  """The step's memory per device (report.memory: arguments + outputs that do not reuse a
  donated argument + temporaries), in GiB for the report."""
  m = report.memory(compiled)
  if not m:
    return {}
  return {"memory_gib_per_device": m["peak_estimate_bytes"] / 2**30, "temp_gib_per_device": m["temp_bytes"] / 2**30}


def format_table(r: dict[str, Any]) -> str:
  """The figures a reader wants, one per line."""
  rows = [
      ("experiment", r["exp"]),
      ("devices", f"{r['device_count']} x {r['device_kind']} ({r['platform']}), mesh {r['mesh']}"),
      ("model", f"{r['params']:,} params, dtype {r['dtype']}, attention {r['attention']}, "
                f"remat {r['remat']}"),
      ("batch", f"{r['global_batch']} x {r['seq_len']} tokens ({r['data_source']} data)"),
      ("steps", f"{r['warmup_steps']} warm-up + {r['steps']} timed (compile {r['compile_s']:.1f} s)"),
      ("step_time_s", f"median {r['step_time_s_median']:.4f}  p10 {r['step_time_s_p10']:.4f}  "
                      f"p90 {r['step_time_s_p90']:.4f}"),
      ("tokens_per_s", f"{r['tokens_per_s']:,.0f}"),
      ("model_flops_per_step", f"{r['model_flops_per_step']:.4g}"),
      ("tflops_per_device", f"{r['tflops_per_device']:.4f}"),
      ("peak_tflops_per_device", f"{r['peak_tflops_per_device']:.4f}  [{r['peak_source']}]"),
      *([("probe", f"{r['probe_samples']} samples, best {r['probe_best_flops'] / 1e9:.1f} GFLOP/s, "
                   f"median {r['probe_median_flops'] / 1e9:.1f} ({r['probe_spread']:.1%} below best); "
                   f"best by the wall clock {r['probe_best_wall_flops'] / 1e9:.1f}")]
        if "probe_samples" in r else []),
      ("mfu", f"{r['mfu']:.1%}  (= {r['tflops_per_device']:.4f} / {r['peak_tflops_per_device']:.4f} "
              f"TFLOP/s per device; model FLOPs: {r.get('flops_convention', '')})"),
      ("hfu", f"{r['hfu']:.1%}  [compiled FLOPs, {r['hardware_flops_per_device']:.4g} per device]"
              if "hfu" in r else "- (XLA's cost model does not count cuBLAS / cuDNN calls)"),
      *([("memory_per_device", f"{r['memory_gib_per_device']:.1f} GiB (of which temporaries "
                               f"{r['temp_gib_per_device']:.1f})")] if "memory_gib_per_device" in r else []),
      *([("mfu_cpu_time", f"{r['mfu_cpu_time']:.1%}  (step {r['step_cpu_s_median']:.3f} CPU s; "
                          f"unaffected by other jobs)")] if "mfu_cpu_time" in r else []),
      ("eval_loss", f"{r['eval_loss']:.4f}"),
  ]
  return "\n".join(f"{k:<24} {v}" for k, v in rows)
