"""Hugging Face checkpoints in and out: the file I/O (safetensors <-> orbax).

What config.json and the tensor names mean is each family's adapter (models/hf/); this
package moves the bytes:

  safetensors.py  the file format: streamed per-tensor reads, streamed writes, shard indexes
  importer.py     a model directory -> the job's step-0 checkpoint, tensor by tensor
  exporter.py     the latest checkpoint -> config.json + safetensors + tokenizer

Nothing in a model directory is executed: config.json is read as JSON, weights as raw
tensors, and no `trust_remote_code` path exists.
"""
