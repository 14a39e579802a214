"""What the Hugging Face tests share: import a fixture model, run it, and check its logits,
greedy tokens, training loss and export against what transformers recorded.

The fixtures (tests/fixtures/hf/, written by tests/fixtures/make_hf_fixtures.py in its own
torch environment) hold small random-weight models of each architecture as transformers saved
them, with transformers' logits, greedy tokens and training losses in `reference.npz`.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardax import configs
from shardax.models import hf as hf_models
from shardax.sharding import make_mesh, use_rules
from shardax.trainer import decode
from shardax.trainer import state as state_lib
from shardax.trainer.hf import exporter, importer, safetensors

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
PAD_TO = 32


def experiment(arch, *overrides):
  cfg = configs.get(f"hf:{os.path.join(FIXTURES, arch)}")
  configs.apply_overrides(cfg, list(overrides))
  return configs.build(cfg)


def imported_from(exp, source, num_devices=1):
  """(setup, params) of the checkpoint in `source` imported onto `exp`'s mesh of the first
  `num_devices` devices."""
  setup = state_lib.create(exp, make_mesh(exp.mesh, jax.devices()[:num_devices]))
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, exp.sharding.allow_uneven):
    return setup, importer.import_params(setup, source)


def imported(arch, mesh_shape=(1, 1), *overrides):
  """(setup, params) of the fixture model imported onto a mesh of the first devices."""
  exp = experiment(arch, f"mesh.ici={mesh_shape}", *overrides)
  return imported_from(exp, os.path.join(FIXTURES, arch), int(np.prod(mesh_shape)))


def reference(arch):
  return dict(np.load(os.path.join(FIXTURES, arch, "reference.npz")))


def logits_of(setup, params, ref, rows=3):
  """Logits of the recorded sequences, right-padded to one batch (causal: padding after a
  sequence does not change its logits)."""
  n = len([k for k in ref if k.startswith("tokens_")])
  tokens = np.zeros((max(rows, n), PAD_TO), np.int32)
  for j in range(n):
    tokens[j, :ref[f"tokens_{j}"].size] = ref[f"tokens_{j}"]
  with jax.set_mesh(setup.mesh), use_rules(setup.rules, setup.exp.sharding.allow_uneven):
    out = jax.jit(lambda p, t: setup.model(p)(t))(params, jnp.asarray(tokens))
  out = np.asarray(out)
  return [out[j, :ref[f"tokens_{j}"].size] for j in range(n)]


def worst_logit_error(setup, params, arch, rows=3) -> float:
  """The largest |logit - transformers'| over the recorded sequences."""
  ref = reference(arch)
  return max(float(np.abs(g - ref[f"logits_{j}"]).max()) for j, g in enumerate(logits_of(setup, params, ref, rows)))


def assert_logits_match(setup, params, arch, rows=3, show=False):
  """Every recorded sequence's logits within 1e-4 of transformers'; `show` prints the worst
  difference (the table in docs/huggingface.md, with pytest -s)."""
  ref = reference(arch)
  got = logits_of(setup, params, ref, rows)
  worst = max(float(np.abs(g - ref[f"logits_{j}"]).max()) for j, g in enumerate(got))
  if show:
    print(f"{arch}: max |logit - transformers'| = {worst:.2e}")
  for j, g in enumerate(got):
    np.testing.assert_allclose(g, ref[f"logits_{j}"], atol=1e-4, rtol=0,
                               err_msg=f"{arch} sequence {j} (max difference over all: {worst:.2e})")


def assert_greedy_matches(setup, params, arch):
  """Greedy decode (the cached path) of the recorded short prompt, then of the three longer
  prompts in one batch, gives transformers' tokens."""
  ref = reference(arch)
  gen = decode.Generator(setup.exp.model, params, setup.mesh, setup.rules)
  result = gen.run([ref["prompt"].tolist()], decode.Sampling(max_new_tokens=ref["greedy"].size))
  assert result.ids[0][:result.counts[0]].tolist() == ref["greedy"].tolist()
  prompts = [ref[f"prompt_{j}"].tolist() for j in range(3)]
  result = gen.run(prompts, decode.Sampling(max_new_tokens=ref["greedy_0"].size))
  for j in range(3):
    assert result.ids[j][:result.counts[j]].tolist() == ref[f"greedy_{j}"].tolist(), f"{arch} prompt {j}"


def train_batch(tokens):
  """transformers' training batch (labels = the tokens) as shardax's: every token routed and
  attended, the last position's target masked (transformers predicts l - 1 tokens a row)."""
  b, l = tokens.shape
  mask = np.ones((b, l), np.float32)
  mask[:, -1] = 0
  return {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, axis=1)),
          "loss_mask": jnp.asarray(mask)}


def train_loss(setup, params, tokens):
  """(loss, metrics) of loss_and_metrics on `train_batch(tokens)`: each scalar a float, the rest
  numpy arrays."""
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    loss, metrics = jax.jit(lambda p, b: setup.model(p).loss_and_metrics(b))(params, train_batch(tokens))
  return float(loss), jax.tree.map(lambda v: float(v) if np.ndim(v) == 0 else np.asarray(v), metrics)


def assert_same_tensors(source, out, leave_out=()):
  """The checkpoint in `out` holds the tensors of `source` (less `leave_out`), in the same order,
  each of the same dtype and shape and bit for bit. Returns their names."""
  a, b = safetensors.Reader(source), safetensors.Reader(str(out))
  assert [n for n in a.names() if n not in leave_out] == b.names()
  for name in b.names():
    x, y = a.get(name), b.get(name)
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
  return b.names()


def assert_export_bit_exact(params, model, hf_arch, source, out):
  """`params` exported to `out`: the tensors of `source` bit for bit, the tied head left out
  when the model ties it. Returns the exported names."""
  exporter.export_params(params, model, hf_arch, str(out), np.float32, 1 << 30)
  return assert_same_tensors(source, out, ("lm_head.weight",) if model.tied_embedding else ())


def assert_export_dequantized(params, model, hf_arch, source, out, want):
  """`params`, imported from a quantized copy of `source`, exported to `out` in float32: the
  tensors of `source` in the same order, each equal to its dequantized value in `want` where the
  copy quantized it, else to the source's."""
  exporter.export_params(params, model, hf_arch, str(out), np.float32, 1 << 30)
  a, b = safetensors.Reader(source), safetensors.Reader(str(out))
  assert a.names() == b.names()
  for name in b.names():
    np.testing.assert_array_equal(b.get(name), want.get(name, a.get(name)), err_msg=name)


def assert_config_round_trips(adapter, model, hf_arch, source):
  """The adapter accepts `model` for export, and its config.json holds every key of the
  source's with the source's value and maps back to the same model (and MoE) fields."""
  src_cfg = hf_models.read(source)
  adapter.check_exportable(model, hf_arch)
  out = adapter.to_hf(model, hf_arch, src_cfg)
  assert {k: out.get(k) for k in src_cfg} == src_cfg
  assert adapter.model_fields(out) == adapter.model_fields(src_cfg)
  assert adapter.moe_fields(out) == adapter.moe_fields(src_cfg)
  return out


def through_checkpoint(exp, tmp_path):
  """The checkpoint `exp` names imported into a step-0 checkpoint of a fresh job under `tmp_path`,
  then exported from it: the export's directory."""
  job, out = str(tmp_path / "job"), str(tmp_path / "out")
  importer.run(exp, job)
  exporter.run(exp, job, out)
  return out


def assert_config_refused(tmp_path, message, base="llama", **changes):
  """The fixture `base`'s config.json with `changes` (write_config) is refused on reading with a
  ConfigError matching `message`."""
  from shardax.configs.schema import ConfigError
  d = write_config(str(tmp_path / "m"), base, **changes)
  with pytest.raises(ConfigError, match=message):
    configs.get(f"hf:{d}")


def write_config(d, base="llama", **changes):
  """A config.json in `d`: the fixture `base`'s with `changes` (a None value drops the key)."""
  cfg = {**hf_models.read(os.path.join(FIXTURES, base)), **changes}
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({k: v for k, v in cfg.items() if v is not None}, f)
  return d

