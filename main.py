"""The command line: `shardax --exp=NAME --job_dir=DIR [--mode=...] [--set PATH=VALUE ...]`.

`main` parses the flags, builds the experiment once and hands it to its mode's runner.
The modes are one table, `MODES` (train, the default; eval, decode, explain, benchmark,
dry_run, plan, list, import and export of Hugging Face checkpoints, goodput): each entry
says what runs it, whether it holds the job dir's lease, whether it accepts a TPU topology
and under which name it writes the resolved config and log. Every mistake a user can make
here (an unknown experiment, a mistyped --set path, a mesh that does not match the
devices) ends in one line naming the problem and the fix, before anything in the job dir
is written.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
from typing import Callable

AT_EXIT = []   # registered before jax is imported, so run after jax's own exit handlers (LIFO)
atexit.register(lambda: [f() for f in AT_EXIT])
from shardax.trainer import platform  # decides the platform before jax starts a backend

PLATFORM = platform.apply()
from shardax.trainer import logs  # noqa: E402  (stdlib only: safe before jax and TensorFlow load)
logs.quiet_native_logs()

from absl import app, flags, logging  # noqa: E402

flags.DEFINE_string("exp", None, "Registered experiment name (see --mode=list).")
flags.DEFINE_string("job_dir", None, "Directory for config, checkpoints, metrics and reports.")
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


def _set_cpu_devices(exp) -> None:
  import jax
  n = exp.mesh.num_cpu_devices
  if n:
    try:
      jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError as e:
      raise UserError(f"mesh.num_cpu_devices={n} must be set before jax starts ({e})") from None


def write_config(exp, job_dir: str, prefix: str) -> None:
  """The resolved config and, from now on, the full log in the job dir, under the names a
  mode's `writes` gives: config.txt, config.json and log.txt for prefix "" (the job's own),
  dry_run.config.txt, dry_run.config.json and dry_run.log.txt for "dry_run.". Process 0 only."""
  from shardax.configs import registry
  from shardax.trainer import distributed
  if not distributed.is_primary():
    return
  from shardax.trainer import jobdir
  root = jobdir.path(job_dir)   # a local directory or gs://bucket/run
  logs.to_job_dir(str(root), prefix + logs.LOG_NAME)
  jobdir.write_text(root / f"{prefix}config.txt", registry.to_text(exp))
  jobdir.write_text(root / f"{prefix}config.json", registry.to_json(exp))


# The runners: run(exp, job_dir, args, record). `args` are the parsed flags; `record()` writes
# the config and log as the mode's entry says (nothing for a mode that writes none).

def _train(exp, job_dir: str, args, record) -> None:
  _hf_import_if_new(exp, job_dir)
  from shardax.trainer import distributed, goodput, loop
  rec = goodput.Recorder(job_dir, write=distributed.is_primary())   # from the process's start
  AT_EXIT.append(rec.at_exit)
  summary = loop.train(exp, job_dir, on_ready=record, recorder=rec)
  evals = summary["eval_losses"]
  if summary["start_step"] == summary["final_step"]:
    print(f"nothing to do: {job_dir} is already at step {summary['final_step']} "
          f"(raise --set train.steps to train further)", flush=True)
  elif evals:
    first, last = next(iter(evals.items())), list(evals.items())[-1]
    print(f"done: steps {summary['start_step']} -> {summary['final_step']} in "
          f"{summary['seconds']:.0f}s; eval_loss {first[1]:.4f} (step {first[0]}) -> "
          f"{last[1]:.4f} (step {last[0]})", flush=True)


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


def _import(exp, job_dir: str, args, record) -> None:
  from shardax.trainer.hf import importer
  record()
  importer.run(exp, job_dir)


def _export(exp, job_dir: str, args, record) -> None:
  from shardax.trainer.hf import exporter
  if not args.hf_out:
    raise UserError("--mode=export needs --hf_out=DIR, the Hugging Face model directory to write")
  exporter.run(exp, job_dir, os.path.expanduser(args.hf_out), args.hf_shard_mb << 20)


def _goodput(exp, job_dir: str, args, record) -> None:
  """The job's goodput across its runs (trainer/goodput.py)."""
  from shardax.trainer import goodput
  print(goodput.format_report(goodput.read(job_dir)), flush=True)


def _eval(exp, job_dir: str, args, record) -> None:
  from shardax.trainer import loop
  print(loop.format_eval(0, 0, exp, loop.evaluate(exp, job_dir)).split("| ", 1)[1], flush=True)


def _decode(exp, job_dir: str, args, record) -> None:
  from shardax.trainer import decode
  decode.print_completions(decode.from_job_dir(exp, job_dir, _prompts(args), _sampling(exp, args)))


def _prompts(args) -> list[str]:
  if args.prompt and args.prompts_file:
    raise UserError("give --prompt (repeatable) or --prompts_file, not both")
  if args.prompts_file:
    from shardax.trainer import decode
    return decode.read_prompts(args.prompts_file)
  return args.prompt or ["def "]


def _sampling(exp, args):
  from shardax.trainer import decode
  stops = []
  for text in args.stop:
    ids = decode.tokenizer(exp).encode(text)
    if len(ids) != 1:
      raise UserError(f"--stop={text!r} is {len(ids)} tokens; each stop must be exactly one token")
    stops.append(int(ids[0]))
  return decode.Sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens,
                         tuple(stops), exp.train.seed if args.seed is None else args.seed)


def _benchmark(exp, job_dir: str, args, record) -> None:
  """Throughput; with train.target_eval_loss set, time to train."""
  record()
  if exp.train.target_eval_loss is None:
    from shardax.perf import benchmark
    print(benchmark.format_table(benchmark.run(exp, job_dir)), flush=True)
    return
  from shardax.perf import mlperf
  r = mlperf.time_to_train(exp, job_dir)
  print(f"time_to_train {r['time_to_train_s']:.1f} s: eval_loss {r['final_eval_loss']:.4f} "
        f"{'reached' if r['reached'] else 'did NOT reach'} target {r['target_eval_loss']} "
        f"after {r['steps']} steps ({r['samples']} samples)", flush=True)


def _explain(exp, job_dir: str, args, record) -> None:
  from shardax.trainer import explain
  print(explain.explain(exp, job_dir), flush=True)


def _dry_run(exp, job_dir: str, args, record) -> None:
  from shardax.perf import dry_run, extrapolate
  record()
  result = extrapolate.dry_run(exp, job_dir, full=not args.shallow, effort=args.compile_effort or 0.0)
  print(dry_run.format_report(result) + "\n" + extrapolate.format_path(result), flush=True)
  if result["fits"] is False:
    print(f"shardax: {exp.name} does not fit on {result['topology'] or 'these devices'}: "
          f"{result['bytes_per_device']['total'] or 0:,} bytes per device needed, "
          f"{result['hbm_bytes_per_device']:,} available. {result['hint']}", file=sys.stderr, flush=True)
    sys.exit(1)


def _plan(exp, job_dir: str, args, record) -> None:
  from shardax.perf import plan
  record()
  effort = -1.0 if args.compile_effort is None else args.compile_effort
  result = plan.plan(exp, plan.Base(args.exp, args.set), job_dir, effort=effort, shallow=args.shallow,
                     quantization=tuple(q for q in args.plan_quantization.split(",") if q))
  print(plan.format_plan(result), flush=True)


def _list(exp, job_dir: str, args, record) -> None:
  from shardax import configs
  for name, desc in configs.names().items():
    print(f"{name:<28} {desc}")


@dataclasses.dataclass(frozen=True)
class Mode:
  """One --mode: its runner and what it may touch.

  run: run(exp, job_dir, args, record) does the mode's work (see the runners above); it
    calls record() once the config is known to fit the job dir (train: once its state is
    built or restored; the others before their work).
  leased: it writes checkpoints, metrics or imported weights, so it holds the job dir's
    lease (trainer/jobdir.py Lease) from before its first write: a second job on the same
    job dir stops there, naming the holder. The other modes may run beside a live job.
  topology: it accepts `mesh.topology`, TPUs that are not here (it compiles, never runs).
  writes: None (it writes no config or log), or the prefix of the names under which it
    writes the resolved config and the full log: "" for the job's own config.txt,
    config.json and log.txt, which only a leased mode may write, "dry_run." for
    dry_run.config.txt, dry_run.config.json and dry_run.log.txt.
  needs_job: it needs --exp and --job_dir (False: it runs before either is read).
  """
  run: Callable[..., None]
  leased: bool = False
  topology: bool = False
  writes: str | None = None
  needs_job: bool = True

  def __post_init__(self):
    if (self.writes == "") != self.leased:
      raise ValueError(f"{self.run.__name__}: a mode writes the job's own config and log (writes='') "
                       f"exactly when it holds the lease (leased=True)")


# --mode's choices, in the order --help lists them.
MODES = {
    "train": Mode(_train, leased=True, writes=""),
    "eval": Mode(_eval),
    "decode": Mode(_decode),
    "explain": Mode(_explain, topology=True),
    "benchmark": Mode(_benchmark, leased=True, writes=""),
    "dry_run": Mode(_dry_run, topology=True, writes="dry_run."),
    "plan": Mode(_plan, topology=True, writes="plan."),
    "list": Mode(_list, needs_job=False),
    "import": Mode(_import, leased=True, writes=""),
    "export": Mode(_export),
    "goodput": Mode(_goodput),
}
flags.DEFINE_enum("mode", "train", list(MODES), "What to do.")


def run_mode(name: str, exp, job_dir: str, args=FLAGS) -> None:
  """Run mode `name` as its entry says: under the job dir's lease if it holds one."""
  mode = MODES[name]
  record = (functools.partial(write_config, exp, job_dir, mode.writes) if mode.writes is not None
            else lambda: None)
  if not mode.leased:
    return mode.run(exp, job_dir, args, record)
  from shardax.trainer import distributed
  lease = distributed.lease(job_dir)   # before data preparation, import or restore: a second
  lease.acquire()                      # job on this job dir stops here, naming the holder
  try:
    mode.run(exp, job_dir, args, record)
  finally:
    lease.release()


def _check_topology(exp, name: str) -> None:
  if exp.mesh.topology and not MODES[name].topology:
    allowed = [f"--mode={n}" for n in sorted(n for n, m in MODES.items() if m.topology)]
    raise UserError(f"mesh.topology={exp.mesh.topology!r} describes TPUs that are not here; "
                    f"use it with {', '.join(allowed[:-1])} or {allowed[-1]}")


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
    if not MODES[FLAGS.mode].needs_job:
      return run_mode(FLAGS.mode, None, None)
    if not FLAGS.exp:
      raise UserError("--exp is required (shardax --mode=list shows the experiments)")
    if not FLAGS.job_dir:
      raise UserError("--job_dir is required: the directory for checkpoints and metrics")
    if FLAGS.compile_effort is not None and not -1.0 <= FLAGS.compile_effort <= 1.0:
      raise UserError(f"--compile_effort={FLAGS.compile_effort} must be in [-1, 1] (-1: fastest compile)")
    exp = configs.resolve(FLAGS.exp, FLAGS.set)
    _check_topology(exp, FLAGS.mode)
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
