"""Hugging Face import/export throughput on a ~1B-parameter random Llama made locally.

    .venv/bin/python benchmarks/hf_throughput.py [--dir /tmp/hf1b] [--layers 16] [--dtype bfloat16]

Writes a Llama-shaped model (hidden 2048, 16 layers, MLP 5632, vocab 32000, untied:
0.89B params) as sharded safetensors with numpy random weights (no torch), then times
the two conversions on one device: `importer.import_params` (safetensors -> params laid
out for the mesh, scanned and stacked) and `exporter.export_params` (params -> sharded
safetensors). Orbax's own save/restore of the train state is not part of these figures.
Prints MB/s of each (MB = 1e6 bytes of weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import jax
import ml_dtypes
import numpy as np

from shardax import configs
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import state as state_lib
from shardax.trainer.hf import exporter, importer, safetensors


def make_model(d: str, layers: int, dtype) -> int:
  dm, ff, vocab, heads, kv = 2048, 5632, 32000, 16, 8
  hd = dm // heads
  cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dm,
         "intermediate_size": ff, "num_hidden_layers": layers, "num_attention_heads": heads,
         "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
         "hidden_act": "silu", "dtype": np.dtype(dtype).name}
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(cfg, f)
  specs = [("model.embed_tokens.weight", (vocab, dm))]
  for i in range(layers):
    p = f"model.layers.{i}."
    specs += [(p + "input_layernorm.weight", (dm,)), (p + "post_attention_layernorm.weight", (dm,)),
              (p + "self_attn.q_proj.weight", (dm, dm)), (p + "self_attn.k_proj.weight", (kv * hd, dm)),
              (p + "self_attn.v_proj.weight", (kv * hd, dm)), (p + "self_attn.o_proj.weight", (dm, dm)),
              (p + "mlp.gate_proj.weight", (ff, dm)), (p + "mlp.up_proj.weight", (ff, dm)),
              (p + "mlp.down_proj.weight", (dm, ff))]
  specs += [("model.norm.weight", (dm,)), ("lm_head.weight", (vocab, dm))]
  specs = [(n, s, np.dtype(dtype)) for n, s in specs]
  rng = np.random.default_rng(0)
  shapes = {n: s for n, s, _ in specs}
  safetensors.write_model(d, specs, lambda n: (rng.standard_normal(shapes[n], np.float32) * 0.02).astype(dtype),
                          max_bytes=1 << 30)
  return sum(int(np.prod(s)) for _, s, _ in specs)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--dir", default="/tmp/hf1b")
  ap.add_argument("--layers", type=int, default=16)
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  args = ap.parse_args()
  dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
  src, out = os.path.join(args.dir, "src"), os.path.join(args.dir, "out")
  shutil.rmtree(args.dir, ignore_errors=True)
  n = make_model(src, args.layers, dtype)
  cfg = configs.get(f"hf:{src}")
  configs.apply_overrides(cfg, ["mesh.ici=(1, 1)", f"model.param_dtype='{args.dtype}'"])
  exp = configs.build(cfg)
  setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:1]))
  nbytes = n * np.dtype(dtype).itemsize
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    t0 = time.perf_counter()
    params = jax.block_until_ready(importer.import_params(setup, src))
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    exporter.export_params(params, exp.model, "llama", out, dtype, 1 << 30)
    t_export = time.perf_counter() - t0
  print(f"{n / 1e9:.2f}B params, {nbytes / 1e6:.0f} MB {args.dtype}, {jax.device_count()} device(s) "
        f"{jax.devices()[0].platform}: import {t_import:.1f} s = {nbytes / 1e6 / t_import:.0f} MB/s, "
        f"export {t_export:.1f} s = {nbytes / 1e6 / t_export:.0f} MB/s")
  a, b = safetensors.Reader(src), safetensors.Reader(out)
  same = all(a.get(k).tobytes() == b.get(k).tobytes() for k in a.names()[:8])
  print(f"first 8 tensors bit-exact after the round trip: {same}")
  shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
  main()
