"""shardax vs MaxText on the same model and batch, in alternating pairs.

MaxText needs jax 0.11 and lives in its own environment (not part of the test suite):

    python3.12 -m venv /work/wt/venv-maxtext
    /work/wt/venv-maxtext/bin/pip install "maxtext[tpu]==0.2.5" "jax==0.11.2" "jaxlib==0.11.2"

(the `tpu` extra is MaxText's full dependency list; on a CPU it runs with
`hardware=cpu skip_jax_distributed_system=True`). Then, from the repository root,
with shardax importable in the current Python:

    JAX_PLATFORMS=cpu python benchmarks/maxtext_compare.py --pairs 3
    JAX_PLATFORMS=cpu python benchmarks/maxtext_compare.py --dtype bfloat16 --maxtext-python PATH

The model (both tools): decoder-only, d_model 512, 4 layers, 8 heads x 64, gated SiLU MLP
2048, RMSNorm, RoPE, tied embedding, vocab 256, seq 256, batch 8, AdamW with global-norm
clipping 1.0, scanned layers, full remat (MaxText cannot turn remat off), synthetic data,
one CPU device. Each pair runs MaxText's own trainer (`maxtext.trainers.pre_train.train`)
and shardax's `--mode=benchmark` one after the other, in separate processes, alternating
which goes first; each drops its first steps (compile, warm-up) and reports the median of
the rest: MaxText's `completed step: N, seconds: S` lines (its own step clock), shardax's
benchmark.json (each step synchronized). The pair's ratio is shardax / MaxText median step
time. Both tools' own FLOP counts per step are printed: MaxText's `Per train step: Total
TFLOPs` line, shardax's `model_flops_per_step`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = dict(d_model=512, layers=4, heads=8, head_dim=64, mlp=2048, vocab=256, seq=256, batch=8)
TOTAL = re.compile(r"Total TFLOPs: ([\d.]+)")
STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+)")


def maxtext_args(dtype: str, steps: int, out: str) -> list[str]:
  m = MODEL
  return [f"run_name=shardax_compare", f"base_output_directory={out}", "hardware=cpu",
          "skip_jax_distributed_system=True", "dataset_type=synthetic", f"steps={steps}",
          f"per_device_batch_size={m['batch']}", f"base_emb_dim={m['d_model']}",
          f"base_num_query_heads={m['heads']}", f"base_num_kv_heads={m['heads']}",
          f"head_dim={m['head_dim']}", f"base_mlp_dim={m['mlp']}",
          f"base_num_decoder_layers={m['layers']}", f"vocab_size={m['vocab']}",
          f"max_target_length={m['seq']}", "remat_policy=full", "scan_layers=True",
          "enable_checkpointing=False", "attention=dot_product", f"dtype={dtype}",
          "weight_dtype=float32", "logits_via_embedding=True", "enable_tensorboard=False",
          "enable_dropout=False", "log_period=1", "opt_type=adamw", "gradient_clipping_threshold=1.0"]


def shardax_args(dtype: str, steps: int, warmup: int, job_dir: str) -> list[str]:
  m = MODEL
  sets = [f"model.d_model={m['d_model']}", f"model.num_layers={m['layers']}",
          f"model.num_heads={m['heads']}", f"model.d_ff={m['mlp']}", f"model.vocab_size={m['vocab']}",
          f"data.seq_len={m['seq']}", f"model.max_len={m['seq']}", f"train.global_batch={m['batch']}",
          "data.source='synthetic'", "model.remat='full'", "model.scan_layers=True",
          f"model.dtype='{dtype}'", f"train.benchmark_steps={steps}",
          f"train.benchmark_warmup={warmup}", "train.eval_batches=1"]
  return ["-m", "shardax.main", "--exp=lm.small", f"--job_dir={job_dir}", "--mode=benchmark"] + \
         [a for s in sets for a in ("--set", s)]


def run_maxtext_process(python: str, dtype: str, steps: int, skip: int) -> dict:
  """MaxText's trainer for skip + steps steps: (median step s, FLOPs per step)."""
  find = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                        capture_output=True, text=True, check=True)
  base = os.path.join(find.stdout.strip(), "configs", "base.yml")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["JAX_PLATFORMS"] = "cpu"
  with tempfile.TemporaryDirectory() as out:
    p = subprocess.run([python, "-m", "maxtext.trainers.pre_train.train", base]
                       + maxtext_args(dtype, skip + steps, out), env=env, capture_output=True, text=True)
  rows = [(int(a), float(b), float(c)) for a, b, c in STEP.findall(p.stdout + p.stderr)]
  if p.returncode or len(rows) < skip + steps:
    raise SystemExit(f"MaxText failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
  timed = rows[skip:]
  total = TOTAL.search(p.stdout + p.stderr)   # MaxText's own count, printed once (2 decimals)
  return {"median_s": statistics.median(r[1] for r in timed),
          "flops_per_step": float(total.group(1)) * 1e12 if total else
          statistics.median(r[1] * r[2] * 1e12 for r in timed)}


def run_shardax(dtype: str, steps: int, skip: int) -> dict:
  with tempfile.TemporaryDirectory() as job_dir:
    p = subprocess.run([sys.executable] + shardax_args(dtype, steps, skip, job_dir),
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
    if p.returncode:
      raise SystemExit(f"shardax failed (rc {p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    with open(os.path.join(job_dir, "benchmark.json")) as f:
      r = json.load(f)
  return {"median_s": r["step_time_s_median"], "flops_per_step": r["model_flops_per_step"]}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--maxtext-python", default="/work/wt/venv-maxtext/bin/python",
                  help="the Python of the environment MaxText is installed in")
  ap.add_argument("--pairs", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
  ap.add_argument("--skip", type=int, default=2, help="first steps dropped (compile, warm-up)")
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  args = ap.parse_args()
  if not os.path.exists(args.maxtext_python):
    raise SystemExit(f"--maxtext-python {args.maxtext_python} does not exist; install MaxText as the "
                     f"docstring says (python {__file__} --help)")
  print(f"model {MODEL}, dtype {args.dtype}, full remat, scanned, 1 CPU device; "
        f"{args.steps} timed steps per run after {args.skip}")
  ratios = []
  for i in range(args.pairs):
    load = os.getloadavg()[0]
    order = ["maxtext", "shardax"] if i % 2 == 0 else ["shardax", "maxtext"]
    res = {}
    for tool in order:
      t0 = time.perf_counter()
      res[tool] = (run_maxtext_process(args.maxtext_python, args.dtype, args.steps, args.skip)
                   if tool == "maxtext" else run_shardax(args.dtype, args.steps, args.skip))
      res[tool]["wall_s"] = time.perf_counter() - t0
    ratios.append(res["shardax"]["median_s"] / res["maxtext"]["median_s"])
    print(f"pair {i + 1} ({' then '.join(order)}, load {load:.1f}): shardax {res['shardax']['median_s']:.3f} s, "
          f"MaxText {res['maxtext']['median_s']:.3f} s, ratio {ratios[-1]:.3f}; FLOPs per step: "
          f"shardax {res['shardax']['flops_per_step']:.4g}, MaxText {res['maxtext']['flops_per_step']:.4g}",
          flush=True)
  print(f"median ratio shardax / MaxText over {len(ratios)} pairs: {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
  main()
