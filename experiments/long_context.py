"""Long-context language models: Llama-3.1 shapes at 8192 tokens, checked with `--mode=dry_run`.

`shardax --exp=lm.llama3_8b_8k --job_dir=/tmp/l8 --mode=dry_run` compiles the real train
step for the slice in `mesh.topology` on any CPU machine with libtpu
(docs/results/long_context.md has the figures). What makes them fit, where XLA's attention did not
(issue 21: a 3-layer copy of the 8B model asked a v6e chip for 57.4 GiB):
  * `model.attention='auto'`: the Pallas splash flash kernel when compiling for a TPU
    (layers/flash.py): no [batch, heads, S, S] scores, ever; cuDNN's on a GPU;
  * FSDP (`sharding.preset=fsdp`): params, gradients and AdamW state split over every
    chip, weights all-gathered layer by layer inside the scan;
  * rematerialization of each scanned layer; `model.remat='offload'` also moves the saved
    layer inputs to host memory (layers/transformer.py), `--mode=plan` ranks the choices.
Shapes are Llama-3.1's (config.json of meta-llama/Llama-3.1-8B / -70B): RMSNorm, SwiGLU,
grouped-query attention with 8 kv heads of 128, RoPE theta 500000, 128256-token vocabulary,
untied head. bf16 compute with fp32 params (the AdamW update stays in fp32). Synthetic data:
these are sized for pods; to train, point `data.source` at a tokenized corpus with
`data.tokenizer` for that vocabulary and drop `mesh.topology`.

At 32k tokens one sequence no longer fits a chip's share (its layer inputs, logits and
gathered K/V), so `lm.llama3_8b_32k` splits the sequence over a `context` mesh axis
(layers/context_parallel.py, preset `fsdp_cp`: batch over `data`, the sequence over
`context`, weights over both): 'allgather' K/V and the splash kernel on each chip's
query rows (two load-balanced chunks), with RoPE at Llama 3.1's llama3 scaling.
"""

from shardax.configs import experiment, register


def _llama3(num_layers: int, d_model: int, num_heads: int, d_ff: int, *, topology: str,
            ici: tuple[int, ...], per_chip: int, seq_len: int = 8192, remat: str = "full"):
  """Llama-3.1 shapes, FSDP over (data, model=1); `per_chip` sequences per chip."""
  cfg = experiment()
  m = cfg.model
  m.vocab_size = 128256
  m.num_layers = num_layers
  m.d_model = d_model
  m.num_heads = num_heads
  m.num_kv_heads = 8
  m.head_dim = 128
  m.d_ff = d_ff
  m.max_len = seq_len
  m.rope_theta = 500_000.0
  m.tied_embedding = False
  m.dtype = "bfloat16"
  m.param_dtype = "float32"
  m.remat = remat
  m.scan_layers = True
  m.attention = "auto"
  cfg.data.source = "synthetic"
  cfg.data.seq_len = seq_len
  cfg.mesh.topology = topology
  cfg.mesh.ici = ici
  cfg.sharding.preset = "fsdp"
  chips = 1
  for n in ici:
    chips *= n
  cfg.train.global_batch = per_chip * chips
  cfg.train.steps = 100_000
  cfg.optimizer.learning_rate = 3e-4
  cfg.optimizer.warmup_steps = 2000
  return cfg


@register("lm.llama3_8b_8k", "Llama-3.1-8B shapes at 8192 tokens, FSDP on TPU v6e-8 (3 seqs/chip), flash attention")
def llama3_8b_8k():
  # remat='full' with the kernel still needs 36.65 GiB of a v6e chip's 31.25 GiB (dry run,
  # 2026-11-23); offloading the saved layer inputs to host brings it to 30.60 GiB.
  return _llama3(32, 4096, 32, 14336, topology="v6e:2x4", ici=(8, 1), per_chip=3, remat="offload")


@register("lm.llama3_70b_8k", "Llama-3.1-70B shapes at 8192 tokens, FSDP on TPU v6e-256 (1 seq/chip), flash attention, offloaded layer inputs")
def llama3_70b_8k():
  # remat='full' peaks at 31.88 GiB, over the 31.25 GiB the TPU compiler allows a program on
  # a v6e chip (dry run, 2026-11-25); offloading the saved layer inputs (10 GiB on host, its
  # transfers hidden under compute) brings it to 18.96 GiB at the same predicted step.
  return _llama3(80, 8192, 64, 28672, topology="v6e:16x16", ici=(256, 1), per_chip=1, remat="offload")


@register("lm.mistral_7b_8k", "Mistral-7B shapes at 8192 tokens, FSDP on TPU v6e-8 (6 seqs/chip, MaxText's "
          "recipe's batch): offloaded layer inputs, chunked loss")
def mistral_7b_8k():
  # MaxText's published v6e-8 recipe trains 6 x 8192 per chip (offloading the layer input and
  # the q/k/v/out projections). Dry runs, 2026-11-26 (docs/results/long_context.md,
  # "Where the memory goes"):
  # offload_proj with the loss in one piece 33.27 GiB of 31.25 (the [6, 8192, 32000] f32 logits
  # and their gradient: 8.8 GiB); offload_proj + loss_chunk 30.84 GiB, 0.41 spare, its 42 GiB
  # of host round trips 2.6 s longer than the step's compute; offload + loss_chunk 28.30 GiB,
  # 12 GiB on host hidden under compute, 5.142 s predicted (51.1% MFU).
  cfg = _llama3(32, 4096, 32, 14336, topology="v6e:2x4", ici=(8, 1), per_chip=6, remat="offload")
  cfg.model.vocab_size = 32000
  cfg.model.rope_theta = 1_000_000.0   # Mistral-7B v0.2+; no sliding window
  cfg.model.norm_eps = 1e-5
  cfg.model.loss_chunk = 1024
  return cfg


@register("lm.llama3_8b_32k", "Llama-3.1-8B shapes at 32768 tokens on TPU v6e-64: data 16 x context 4 "
          "(all-gather K/V, flash kernel), FSDP over both")
def llama3_8b_32k():
  # Each chip holds a quarter of each of its data replica's 2 sequences (2 x 8192 tokens):
  # 21.86 GiB per chip, predicted 2.441 s, MFU 51.8% (dry run 2026-11-25). The same per
  # chip on v6e:4x8 (data 8 x context 4) predicted MFU 30.4%, memory-bound, with 15,873
  # collective-permutes the square slice's program does not have (docs/results/long_context.md).
  cfg = _llama3(32, 4096, 32, 14336, topology="v6e:8x8", ici=(16, 4), per_chip=1, seq_len=32768)
  cfg.mesh.axes = ("data", "context")
  cfg.sharding.preset = "fsdp_cp"
  cfg.model.context_parallel = "allgather"
  cfg.model.rope_scaling = "llama3"   # Llama 3.1's long-context RoPE (factor 8 from 8192)
  cfg.train.global_batch = 32         # 2 sequences per data replica
  return cfg
