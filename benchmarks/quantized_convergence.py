"""lm.tiny in bf16, int8 and fp8 (model.quantization) side by side: the same data, seed and
steps, the final eval loss and bits per byte of each, and each against bf16.

  .venv/bin/python benchmarks/quantized_convergence.py [--steps 250] [--modes none,int8,fp8]

Each run is the CLI's own training (`shardax --exp=lm.tiny --set model.dtype='bfloat16'
--set model.quantization=MODE`) in a fresh job dir; the figures are read from the job's
metrics.jsonl. On a CPU the 8-bit dots are not faster (XLA:CPU widens fp8 to f32; int8
dots run on the scalar units), so the wall time column says nothing about a TPU or GPU.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time


def last(path: pathlib.Path, key: str):
  value = None
  for line in path.read_text().splitlines():
    row = json.loads(line)
    if key in row:
      value = row[key]
  return value


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=250)
  ap.add_argument("--modes", default="none,int8,fp8")
  ap.add_argument("--exp", default="lm.tiny")
  ap.add_argument("--parallel", action="store_true", help="train the modes at once (shared cores)")
  args = ap.parse_args()
  root = pathlib.Path(tempfile.mkdtemp(prefix="quant_conv_"))
  modes = args.modes.split(",")

  def start(mode):
    cmd = [sys.executable, "-m", "shardax.main", f"--exp={args.exp}", f"--job_dir={root / mode}",
           "--set", "model.dtype='bfloat16'", "--set", f"model.quantization={mode!r}",
           "--set", f"train.steps={args.steps}"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), time.time()

  running = [start(m) for m in modes] if args.parallel else []
  rows = []
  for i, mode in enumerate(modes):
    proc, t = running[i] if args.parallel else start(mode)
    if proc.wait():
      raise SystemExit(f"{mode}: training failed (exit {proc.returncode}); see {root / mode}/log.txt")
    wall = time.time() - t
    metrics = root / mode / "metrics.jsonl"
    rows.append((mode, last(metrics, "eval_loss"), last(metrics, "eval_bits_per_byte"), last(metrics, "loss"), wall))
    print(f"{mode:12s} eval loss {rows[-1][1]:.4f}  bits/byte {rows[-1][2]:.4f}  "
          f"last train loss {rows[-1][3]:.4f}  wall {wall:.0f} s", flush=True)
  base = rows[0]
  print(f"\n{args.exp}, {args.steps} steps, bf16 compute ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
  print("| quantization | eval loss | bits/byte | eval loss / bf16 | wall s |")
  print("|---|---|---|---|---|")
  for mode, loss, bpb, _, wall in rows:
    print(f"| {mode} | {loss:.4f} | {bpb:.4f} | {loss / base[1]:.4f} | {wall:.0f} |")


if __name__ == "__main__":
  main()
