"""Long-context language models: Llama-3.1 shapes at 8192 tokens, checked with `--mode=dry_run`.

`shardax --exp=lm.llama3_8b_8k --job_dir=/tmp/l8 --mode=dry_run` compiles the real train
step for the slice in `mesh.topology` on any CPU machine with libtpu (docs/long_context.md;
the figures are in docs/results/long_context.md). What makes them fit, where XLA's attention
did not:
  * `model.attention='auto'`: the Pallas splash flash kernel when compiling for a TPU
    (layers/flash.py): no [batch, heads, S, S] scores, ever; cuDNN's on a GPU;
  * FSDP (`sharding.preset=fsdp`): params, gradients and AdamW state split over every
    chip, weights all-gathered layer by layer inside the scan;
  * rematerialization of each scanned layer; `model.remat='offload'` also moves the saved
    layer inputs to host memory (layers/transformer.py), `--mode=plan` ranks the choices.
The shapes are configs/shapes.py LLAMA3_8B, LLAMA3_70B and MISTRAL_7B. bf16 compute with fp32
params (the AdamW update stays in fp32). Synthetic data: these are sized for pods; to train,
point `data.source` at a tokenized corpus with `data.tokenizer` for that vocabulary and drop
`mesh.topology`.

At 32k tokens one sequence no longer fits a chip's share (its layer inputs, logits and
gathered K/V), so `lm.llama3_8b_32k` splits the sequence over a `context` mesh axis
(layers/context_parallel.py, preset `fsdp_cp`: batch over `data`, the sequence over
`context`, weights over both): 'allgather' K/V and the splash kernel on each chip's
query rows (two load-balanced chunks), with RoPE at Llama 3.1's llama3 scaling.
"""

import dataclasses

from shardax.configs import register, shapes
from shardax.configs.rope import RopeScaling
from shardax.configs.schema import OptimizerConfig, ShardingConfig
from shardax.experiments import recipes
from shardax.sharding import MeshConfig


def _long(shape, *, topology: str, ici: tuple[int, ...], global_batch: int, seq_len: int = 8192,
          axes: tuple[str, ...] = ("data", "model"), preset: str = "fsdp", **step):
  """`shape` at `seq_len` with the flash kernel, scanned layers and `step`'s settings (remat...),
  FSDP (`preset`) over `ici` on `topology`, AdamW at 3e-4."""
  model = dataclasses.replace(shape, dtype="bfloat16", scan_layers=True, attention="auto", **step)
  return recipes.on_pod(model, seq_len=seq_len, global_batch=global_batch,
                        mesh=MeshConfig(topology=topology, ici=ici, axes=axes), sharding=ShardingConfig(preset=preset),
                        optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2000))


@register("lm.llama3_8b_8k", "Llama-3.1-8B shapes at 8192 tokens, FSDP on TPU v6e-8 (3 seqs/chip), flash attention")
def llama3_8b_8k():
  """remat 'offload': with 'full' the step does not fit a v6e chip's 31.25 GiB; the saved layer
  inputs on the host bring it under."""
  return _long(shapes.LLAMA3_8B, topology="v6e:2x4", ici=(8, 1), global_batch=3 * 8, remat="offload")


@register("lm.llama3_70b_8k", "Llama-3.1-70B shapes at 8192 tokens, FSDP on TPU v6e-256 (1 seq/chip), "
          "flash attention, offloaded layer inputs")
def llama3_70b_8k():
  """remat 'offload': 'full' peaks just over the 31.25 GiB the TPU compiler allows a program on a
  v6e chip; offloading the saved layer inputs, their transfers hidden under compute, fits at the
  same predicted step."""
  return _long(shapes.LLAMA3_70B, topology="v6e:16x16", ici=(256, 1), global_batch=1 * 256, remat="offload")


@register("lm.mistral_7b_8k", "Mistral-7B shapes at 8192 tokens, FSDP on TPU v6e-8 (6 seqs/chip, MaxText's "
          "recipe's batch): offloaded layer inputs, chunked loss")
def mistral_7b_8k():
  """MaxText's published v6e-8 recipe's batch, 6 x 8192 per chip. It fits with the layer inputs
  offloaded (host transfers hidden under compute) and the loss in chunks of 1024 positions (no
  [6, 8192, 32000] f32 logits at once); docs/results/long_context.md, "Where the memory goes",
  has the alternatives."""
  return _long(shapes.MISTRAL_7B, topology="v6e:2x4", ici=(8, 1), global_batch=6 * 8, remat="offload",
               loss_chunk=1024)


@register("lm.llama3_8b_32k", "Llama-3.1-8B shapes at 32768 tokens on TPU v6e-64: data 16 x context 4 "
          "(all-gather K/V, flash kernel), FSDP over both")
def llama3_8b_32k():
  """Each chip holds a quarter of each of its data replica's 2 sequences (2 x 8192 tokens). The
  square slice: on v6e:4x8 (data 8 x context 4) the same per chip is memory-bound, with many
  collective-permutes the square slice's program does not have (docs/results/long_context.md). RoPE at Llama
  3.1's llama3 scaling (factor 8 from 8192)."""
  return _long(shapes.LLAMA3_8B, topology="v6e:8x8", ici=(16, 4), global_batch=2 * 16, seq_len=32768,
               axes=("data", "context"), preset="fsdp_cp", remat="full", context_parallel="allgather",
               rope_scaling=RopeScaling("llama3"))
