"""The command line: `shardax --exp=NAME --job_dir=DIR [--mode=...] [--set PATH=VALUE ...]`.

Modes: train (default), eval, goodput, decode, explain, benchmark, dry_run, plan, list, import and export (Hugging Face checkpoints, trainer/hf/). Every mistake a user can
make here (an unknown experiment, a mistyped --set path, a mesh that does not
match the devices) ends in one line naming the problem and the fix, before
anything in the job dir is written.
"""

from __future__ import annotations

import atexit
import os
import sys

AT_EXIT = []   # registered before jax is imported, so run after jax's own exit handlers (LIFO)
atexit.register(lambda: [f() for f in AT_EXIT])
from shardax.trainer import platform  # decides the platform before jax starts a backend

PLATFORM = platform.apply()
from shardax.trainer import logs  # noqa: E402  (stdlib only: safe before jax and TensorFlow load)
logs.quiet_native_logs()

from absl import app, flags, logging  # noqa: E402

MODES = ("train", "eval", "decode", "explain", "benchmark", "dry_run", "plan", "list", "import", "export",
         "goodput")

flags.DEFINE_string("exp", None, "Registered experiment name (see --mode=list).")
flags.DEFINE_string("job_dir", None, "Directory for config, checkpoints, metrics and reports.")
flags.DEFINE_enum("mode", "train", MODES, "What to do.")
flags.DEFINE_multi_string("set", [], "Config override PATH=VALUE (repeatable), e.g. train.steps=10.")
flags.DEFINE_multi_string("prompt", [], "decode: text to continue (repeatable: one batch).")
flags.DEFINE_string("prompts_file", None, "decode: prompts, JSONL ({\"prompt\": ...} per line) or text lines.")
flags.DEFINE_integer("max_new_tokens", 128, "decode: at most this many new tokens per prompt.")
flags.DEFINE_float("temperature", 0.0, "decode: 0 = greedy, else softmax temperature.")
flags.DEFINE_integer("top_k", 0, "decode: sample among the k most likely tokens (0 = all).")
flags.DEFINE_float("top_p", 1.0, "decode: sample from the smallest set with this probability (1 = all).")
flags.DEFINE_multi_string("stop", [], "decode: a text of one token that ends a completion (repeatable).")
flags.DEFINE_integer("seed", None, "decode: sampling seed (default: train.seed).")
flags.DEFINE_string("coordinator_address", None, "Multi-process: HOST:PORT of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-process: how many processes in the job.")
flags.DEFINE_integer("process_id", None, "Multi-process: this process's id, 0..num_processes-1.")
flags.DEFINE_integer("heartbeat_timeout_s", None,
                     "Multi-process: a process that hears nothing from its peers for this many seconds "
                     "exits non-zero (default: SHARDAX_HEARTBEAT_TIMEOUT_S, else 100).")
flags.DEFINE_bool("single_process", False, "Run as one process even where a cluster launcher is "
                  "present but its detection fails (otherwise that failure stops the job).")
flags.DEFINE_string("plan_quantization", "", "plan: also rank these model.quantization choices, "
                    "comma-separated (e.g. none,int8): each layout once per choice.")
flags.DEFINE_bool("shallow", False, "dry_run/plan: compile shallow copies of a scanned stack and "
                  "extrapolate to full depth (perf/extrapolate.py) instead of the full model.")
flags.DEFINE_float("compile_effort", None, "dry_run/plan: compile effort in [-1, 1] (jax 0.10: "
                   "exec_time_optimization_effort; jax 0.11: -1 -> optimization level O0); -1 compiles "
                   "~5x faster. Default: 0 for dry_run, -1 for plan.")
flags.DEFINE_string("hf_out", None, "export: the Hugging Face model directory to write.")
flags.DEFINE_integer("hf_shard_mb", 4096, "export: safetensors files above this many MB are split, with an index.")
FLAGS = flags.FLAGS


class UserError(Exception):
  """A mistake in the command line or config: reported in one line, exit status 2."""


def resolve_experiment(name: str, overrides: list[str]):
  from shardax import configs
  cfg = configs.get(name)
  configs.apply_overrides(cfg, overrides)
  return configs.build(cfg)


def _set_cpu_devices(exp) -> None:
  import jax
  n = exp.mesh.num_cpu_devices
  if n:
    try:
      jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError as e:
      raise UserError(f"mesh.num_cpu_devices={n} must be set before jax starts ({e})") from None


def write_config(exp, job_dir: str, mode: str) -> None:
  """The resolved config (config.txt, config.json) in the job dir, and from now on the full
  log (log.txt), for a mode that holds the job dir's lease. A mode without the lease may run
  beside a live job, so it never touches that job's files: it writes its own, named after
  it (dry_run.config.txt, dry_run.config.json, dry_run.log.txt)."""
  from shardax.configs import registry
  from shardax.trainer import distributed
  if not distributed.is_primary():
    return
  from shardax.trainer import jobdir
  root = jobdir.path(job_dir)   # a local directory or gs://bucket/run
  prefix = "" if mode in LEASED_MODES else f"{mode}."
  logs.to_job_dir(str(root), prefix + logs.LOG_NAME)
  jobdir.write_text(root / f"{prefix}config.txt", registry.to_text(exp))
  jobdir.write_text(root / f"{prefix}config.json", registry.to_json(exp))


def _hf_import_if_new(exp, job_dir: str) -> None:
  """The first --mode=train of an hf:DIR experiment starts from the imported weights."""
  from shardax.trainer import checkpoint as ckpt_lib
  if not exp.name.startswith("hf:") or not exp.checkpoint.enabled:
    return
  with ckpt_lib.Checkpointer(os.path.join(job_dir, "checkpoints"), exp.checkpoint) as ckpt:
    if ckpt.latest_step() is not None:
      return
  from shardax.trainer.hf import importer
  importer.run(exp, job_dir)


# Modes that write checkpoints, metrics or imported weights hold the job dir's lease from
# their first write (trainer/jobdir.py Lease), and they alone write its config.txt,
# config.json and log.txt; the others only read it or add reports named after themselves
# beside it (eval, decode, explain, dry_run, plan, export), so they may run next to a job.
LEASED_MODES = ("train", "import", "benchmark")


def run_mode(mode: str, exp, job_dir: str) -> None:
  if mode not in LEASED_MODES:
    return _run(mode, exp, job_dir)
  from shardax.trainer import distributed
  lease = distributed.lease(job_dir)   # before data preparation, import or restore: a second
  lease.acquire()                      # job on this job dir stops here, naming the holder
  try:
    _run(mode, exp, job_dir)
  finally:
    lease.release()


def _run(mode: str, exp, job_dir: str) -> None:
  if mode == "import":
    from shardax.trainer.hf import importer
    write_config(exp, job_dir, mode)
    importer.run(exp, job_dir)
    return
  if mode == "export":
    from shardax.trainer.hf import exporter
    if not FLAGS.hf_out:
      raise UserError("--mode=export needs --hf_out=DIR, the Hugging Face model directory to write")
    exporter.run(exp, job_dir, os.path.expanduser(FLAGS.hf_out), FLAGS.hf_shard_mb << 20)
    return
  if mode == "train":
    _hf_import_if_new(exp, job_dir)
    from shardax.trainer import loop
    from shardax.trainer import distributed, goodput
    rec = goodput.Recorder(job_dir, write=distributed.is_primary())   # from the process's start
    AT_EXIT.append(rec.at_exit)
    summary = loop.train(exp, job_dir, on_ready=lambda: write_config(exp, job_dir, mode), recorder=rec)
    evals = summary["eval_losses"]
    if summary["start_step"] == summary["final_step"]:
      print(f"nothing to do: {job_dir} is already at step {summary['final_step']} "
            f"(raise --set train.steps to train further)", flush=True)
    elif evals:
      first, last = next(iter(evals.items())), list(evals.items())[-1]
      print(f"done: steps {summary['start_step']} -> {summary['final_step']} in "
            f"{summary['seconds']:.0f}s; eval_loss {first[1]:.4f} (step {first[0]}) -> "
            f"{last[1]:.4f} (step {last[0]})", flush=True)
  elif mode == "goodput":   # the job's goodput across its runs (trainer/goodput.py)
    from shardax.trainer import goodput
    print(goodput.format_report(goodput.read(job_dir)), flush=True)
  elif mode == "eval":
    from shardax.trainer import loop
    print(loop.format_eval(0, 0, exp, loop.evaluate(exp, job_dir)).split("| ", 1)[1], flush=True)
  elif mode == "decode":
    from shardax.trainer import decode
    decode.print_completions(decode.from_job_dir(exp, job_dir, _prompts(), _sampling(exp)))
  elif mode == "benchmark":  # throughput; with train.target_eval_loss set: time to train
    write_config(exp, job_dir, mode)
    if exp.train.target_eval_loss is None:
      from shardax.perf import benchmark
      print(benchmark.format_table(benchmark.run(exp, job_dir)), flush=True)
    else:
      from shardax.perf import mlperf
      r = mlperf.time_to_train(exp, job_dir)
      print(f"time_to_train {r['time_to_train_s']:.1f} s: eval_loss {r['final_eval_loss']:.4f} "
            f"{'reached' if r['reached'] else 'did NOT reach'} target {r['target_eval_loss']} "
            f"after {r['steps']} steps ({r['samples']} samples)", flush=True)
  elif mode == "explain":
    from shardax.trainer import explain
    print(explain.explain(exp, job_dir), flush=True)
  elif mode == "dry_run":
    from shardax.perf import dry_run
    write_config(exp, job_dir, mode)
    from shardax.perf import extrapolate
    result = extrapolate.dry_run(exp, job_dir, full=not FLAGS.shallow, effort=FLAGS.compile_effort or 0.0)
    print(dry_run.format_report(result) + "\n" + extrapolate.format_path(result), flush=True)
    if result["fits"] is False:
      print(f"shardax: {exp.name} does not fit on {result['topology'] or 'these devices'}: "
            f"{result['bytes_per_device']['total'] or 0:,} bytes per device needed, "
            f"{result['hbm_bytes_per_device']:,} available. {result['hint']}", file=sys.stderr, flush=True)
      sys.exit(1)
  elif mode == "plan":
    from shardax.perf import plan
    write_config(exp, job_dir, mode)
    effort = -1.0 if FLAGS.compile_effort is None else FLAGS.compile_effort
    result = plan.plan(FLAGS.exp, FLAGS.set, job_dir, effort=effort, shallow=FLAGS.shallow,
                       quantization=tuple(q for q in FLAGS.plan_quantization.split(",") if q))
    print(plan.format_plan(result), flush=True)


def _prompts() -> list[str]:
  if FLAGS.prompt and FLAGS.prompts_file:
    raise UserError("give --prompt (repeatable) or --prompts_file, not both")
  if FLAGS.prompts_file:
    from shardax.trainer import decode
    return decode.read_prompts(FLAGS.prompts_file)
  return FLAGS.prompt or ["def "]


def _sampling(exp):
  from shardax.trainer import decode
  stops = []
  for text in FLAGS.stop:
    ids = decode.tokenizer(exp).encode(text)
    if len(ids) != 1:
      raise UserError(f"--stop={text!r} is {len(ids)} tokens; each stop must be exactly one token")
    stops.append(int(ids[0]))
  return decode.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.max_new_tokens,
                         tuple(stops), exp.train.seed if FLAGS.seed is None else FLAGS.seed)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; overrides go in --set PATH=VALUE")
  logs.setup(FLAGS.verbosity if FLAGS["verbosity"].present else None)
  from shardax import configs
  from shardax.configs import registry
  from shardax.trainer.checkpoint import CheckpointError
  from shardax.trainer.distributed import LaunchError
  from shardax.trainer.jobdir import LeaseError
  try:
    registry.check_package()   # a folder named shardax/ here would hide every experiment
    if FLAGS.mode == "list":
      for name, desc in configs.names().items():
        print(f"{name:<28} {desc}")
      return
    if not FLAGS.exp:
      raise UserError("--exp is required (shardax --mode=list shows the experiments)")
    if not FLAGS.job_dir:
      raise UserError("--job_dir is required: the directory for checkpoints and metrics")
    if FLAGS.compile_effort is not None and not -1.0 <= FLAGS.compile_effort <= 1.0:
      raise UserError(f"--compile_effort={FLAGS.compile_effort} must be in [-1, 1] (-1: fastest compile)")
    exp = resolve_experiment(FLAGS.exp, FLAGS.set)
    if exp.mesh.topology and FLAGS.mode not in ("dry_run", "explain", "plan"):
      raise UserError(f"mesh.topology={exp.mesh.topology!r} describes TPUs that are not here; "
                      f"use it with --mode=dry_run, --mode=explain or --mode=plan")
    _set_cpu_devices(exp)
    from shardax.sharding import libtpu_flags
    libtpu_flags.apply(exp.mesh.libtpu_flags)   # libtpu reads them once, when jax first loads it
    from shardax.trainer import compile_cache   # before the first compile, in every mode
    # A topology's programs are compiled for TPUs that are not here: jax cannot read such an
    # entry back ("PjRtCompiler must be constructed with a Client"), so none is written.
    cache_dir = compile_cache.enable("" if exp.mesh.topology else exp.train.compilation_cache_dir,
                                     os.path.expanduser(FLAGS.job_dir))
    from shardax.trainer import distributed
    joined = distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                                    heartbeat_timeout_s=FLAGS.heartbeat_timeout_s,
                                    single_process=FLAGS.single_process)
    distributed.agree_at_start(registry.to_json(exp))
    logging.info(line := platform.describe(PLATFORM, joined))
    print(line, file=sys.stderr, flush=True)  # a status line: shown on the quiet terminal too
    run_mode(FLAGS.mode, exp, os.path.expanduser(FLAGS.job_dir))
    if cache_dir:
      print(f"{compile_cache.summary()} ({cache_dir})", file=sys.stderr, flush=True)
  except (UserError, configs.ConfigError, ValueError, FileNotFoundError, CheckpointError,
          LaunchError, LeaseError) as e:
    logging.debug("error", exc_info=True)
    print(f"shardax: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def run() -> None:
  """Console-script entry point."""
  app.run(main)


if __name__ == "__main__":
  run()
