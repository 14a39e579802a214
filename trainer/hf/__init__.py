"""Hugging Face checkpoints in and out (config.json <-> our config, safetensors <-> orbax).

  config.py       config.json -> TransformerConfig fields and back; unknown math is an error
  safetensors.py  the file format: streamed per-tensor reads, streamed writes, shard indexes
  weights.py      our param tree <-> Hugging Face tensor names and layouts
  importer.py     a model directory -> the job's step-0 checkpoint, tensor by tensor
  exporter.py     the latest checkpoint -> config.json + safetensors + tokenizer

Nothing in a model directory is executed: config.json is read as JSON, weights as raw
tensors, and no `trust_remote_code` path exists.
"""
