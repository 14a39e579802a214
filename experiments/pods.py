"""Dense LMs sized for TPU pods, checked on paper with `--mode=dry_run`.

Each experiment names its slice in `mesh.topology`, so
`shardax --exp=pod.lm_16b --job_dir=/tmp/d --mode=dry_run` compiles the real train
step for that slice on any CPU machine with libtpu and reports per-chip memory,
communication and a roofline (docs/scale.md has the table). To train for real on
the pod, drop the topology: `--set mesh.topology=None`.

Choices shared by all of them (the GSPMD paper's recipe for its dense models):
  * 2D sharding (`sharding.preset=2d`): weights [embed on data, mlp/heads on model],
    activations [batch on data, embed on model]; the model axis stays inside a
    few neighbouring chips, the data axis spans the rest.
  * bf16 params and compute, and Adafactor (`optimizer.name=adafactor`), the optimizer
    the GSPMD paper's dense and MoE runs and GShard trained with: factored second
    moments (one row and one column statistic per weight matrix, no first moment),
    update clipping at RMS 1 and steps relative to each weight's RMS (so the peak
    learning rate is 1e-2, not AdamW's 1e-4). The optimizer state is then ~3% of
    the bf16 params instead of 2x them (AdamW); docs/optimizers.md has the
    per-chip table for pod.lm_1t under AdamW, AdamW + fp32 master and Adafactor
    (`--set optimizer.name=adamw --set optimizer.learning_rate=1e-4` gives AdamW back).
  * Full rematerialization of each scanned layer: only the layer inputs are kept
    for the backward pass (compute x4/3, activation memory / num_layers).
  * d_ff = 4 d_model (gated MLP, so 3 matrices), head_dim 128, vocab 32k, synthetic
    data. Parameters per layer: 4 d^2 (attention) + 12 d^2 (MLP) = 16 d^2.
"""

from shardax.configs import experiment, register


def _pod_lm(d_model: int, num_layers: int, topology: str, ici: tuple[int, int],
            global_batch: int, seq_len: int = 2048):
  cfg = experiment()
  m = cfg.model
  m.vocab_size = 32768
  m.d_model = d_model
  m.num_heads = d_model // 128
  m.d_ff = 4 * d_model
  m.num_layers = num_layers
  m.max_len = seq_len
  m.dtype = "bfloat16"
  m.param_dtype = "bfloat16"
  m.remat = "full"
  m.scan_layers = True
  m.tied_embedding = False
  cfg.data.source = "synthetic"
  cfg.data.seq_len = seq_len
  cfg.mesh.topology = topology
  cfg.mesh.ici = ici
  cfg.sharding.preset = "2d"
  cfg.train.global_batch = global_batch
  cfg.train.steps = 100_000
  cfg.optimizer.name = "adafactor"
  cfg.optimizer.learning_rate = 1e-2
  cfg.optimizer.warmup_steps = 2000
  return cfg


@register("pod.lm_16b", "17.1B dense LM (40 x 5120), 2D sharding on TPU v4-128 (v4:4x4x4, 64 chips)")
def lm_16b():
  return _pod_lm(d_model=5120, num_layers=40, topology="v4:4x4x4", ici=(8, 8), global_batch=256)


@register("pod.lm_128b", "126B dense LM (52 x 12288), 2D sharding on TPU v4-1024 (v4:8x8x8, 512 chips)")
def lm_128b():
  return _pod_lm(d_model=12288, num_layers=52, topology="v4:8x8x8", ici=(32, 16), global_batch=512)


@register("pod.lm_512b", "511B dense LM (76 x 20480), 2D sharding on TPU v5p-2048 (v5p:8x8x16, 1024 chips)")
def lm_512b():
  return _pod_lm(d_model=20480, num_layers=76, topology="v5p:8x8x16", ici=(64, 16), global_batch=1024)


@register("pod.lm_1t", "1.0T dense LM (104 x 24576) on 2048 TPUv3 cores (v3:32x32), the GSPMD paper's scale")
def lm_1t():
  # 16 GiB per core: bf16 params are 0.92 GiB, Adafactor's factored state 0.02 GiB
  # (AdamW's bf16 moments would be 1.83 GiB, fp32 master + moments 5.49 GiB), the
  # layer inputs kept for the backward pass (1M tokens x 24576 x 2 bytes x 104 layers
  # / 2048) 2.5 GiB.
  return _pod_lm(d_model=24576, num_layers=104, topology="v3:32x32", ici=(128, 16),
                 global_batch=1024, seq_len=1024)
