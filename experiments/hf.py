"""`--exp=hf:DIR`: an experiment built from a Hugging Face model directory.

The model comes from DIR/config.json (models/hf/, its family adapter: every key mapped, checked or an
error), the tokenizer is DIR/tokenizer.json encoded as the model's own (its post-processor's
BOS, no separator of shardax's), and the weights come in through `--mode=import` (or the first
`--mode=train`). Everything else is an ordinary experiment: mesh, rules, optimizer and data
come from --set. The defaults suit fine-tuning: a low learning rate, short warmup, float32
master weights; the mesh takes every device on the data axis with the `fsdp` rules
(weights and optimizer state split across data-parallel devices).

A Mixtral is the same LM with `model.moe` set: config.json's attention and norms go to
model.*, its router and experts to model.moe (the adapter's moe_fields), e.g.
`--set model.moe.aux_loss_weight=0`.
"""

from __future__ import annotations

import dataclasses
import os

from shardax.configs import experiment
from shardax.configs.moe import MoEConfig
from shardax.configs.registry import config_of, config_tree, register_prefix
from shardax.models import hf as hf_models
from shardax.models.hf.common import LAYER_PREFIX


def hf_experiment(model_dir: str):
  directory = os.path.abspath(os.path.expanduser(model_dir))
  hf = hf_models.read(directory)
  adapter = hf_models.adapter_for(hf)
  fields, moe = adapter.model_fields(hf), adapter.moe_fields(hf)
  if fields.get("mtp") is not None and not holds_layer(directory, fields["num_layers"]):
    fields["mtp"] = None   # weights without the MTP layers (transformers saves none): train without them
  cfg = experiment(name=f"hf:{directory}", description=f"{hf_models.architecture(hf)} from {directory}")
  if moe is not None:
    cfg.model.moe = config_tree(MoEConfig)
    for key, value in moe.items():
      setattr(cfg.model.moe, key, value)
  model = cfg.model
  for key, value in fields.items():   # sections (rope_scaling, mla) as trees: --set reaches their fields
    setattr(model, key, config_of(value) if dataclasses.is_dataclass(value) else value)
  model.max_len = min(fields["max_len"], 4096)   # export writes the source's length back
  cfg.data.seq_len = min(512, model.max_len)
  tok = os.path.join(directory, "tokenizer.json")
  if os.path.exists(tok):
    cfg.data.tokenizer = f"hf_model:{tok}"
  cfg.train.steps = 100
  cfg.train.global_batch = 8
  cfg.train.eval_every = 50
  cfg.train.eval_batches = 4
  cfg.optimizer.learning_rate = 1e-4
  cfg.optimizer.warmup_steps = 10
  cfg.optimizer.weight_decay = 0.0
  cfg.checkpoint.every = 100
  return cfg


def holds_layer(directory: str, layer: int) -> bool:
  """Whether the directory's weights hold tensors of Hugging Face layer `layer` (a config.json
  alone, as for a dry run, describes the model whole: True)."""
  from shardax.trainer.hf import safetensors
  try:
    names = safetensors.Reader(directory).names()
  except safetensors.SafetensorsError:
    return True
  prefix = LAYER_PREFIX.format(i=layer)
  return any(n.startswith(prefix) for n in names)


register_prefix("hf", hf_experiment)
