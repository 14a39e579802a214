"""8-bit training (model.quantization): close to the bf16 step, 8-bit dots in the program,
the same on a mesh as on one device, and no collective of a quantized tensor that the
bf16 step did not already have for its bf16 twin.

Tolerances (measured 2026-11-25 on this 2-layer LM, bf16 compute, one batch): the loss
moves by 2e-4 (int8) and 2e-3 (fp8) of itself, the gradients by 3% (int8) and 11% (fp8)
of their norm; the tests allow about 2.5x that. The same model with quantization off
(the control) differs from bf16 by 0, and a quantization that did nothing would too, so
each test also asserts a difference above a floor.
"""

import re

import jax
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from shardax import configs
from shardax.layers import quantization
from shardax.sharding import use_rules
from shardax.trainer import state as state_lib
from shardax.trainer import step as step_lib
from meshtools import loss_and_grads, setup_for

# mode -> (max relative loss change, max relative gradient change, min relative gradient change)
BOUNDS = {"int8": (5e-4, 0.08, 0.005), "fp8": (5e-3, 0.25, 0.02), "fp8_delayed": (5e-3, 0.25, 0.02)}


def experiment(quant, preset="dp", ici=(1,), axes=("data",), dtype="bfloat16"):
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.d_ff=128",
      "model.max_len=16", "data.seq_len=16", "train.global_batch=8", "data.source='synthetic'",
      f"model.dtype={dtype!r}", f"model.quantization={quant!r}", f"sharding.preset={preset!r}",
      f"mesh.ici={ici!r}", f"mesh.axes={axes!r}"])
  return configs.build(cfg)


@pytest.fixture(scope="module")
def batch():
  tokens = np.random.default_rng(0).integers(1, 256, size=(8, 17)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def run(exp, batch, devices=None, params=None):
  """(loss, grads, compiled step, params) of one batch; `params` given: their leaves are
  used where this model has them (an fp8_delayed model adds its empty amax histories)."""
  setup = setup_for(exp, devices)
  fresh = jax.device_get(state_lib.init_fn(setup)(jax.random.key(0))["params"])
  params = fresh if params is None else _fill(fresh, params)
  (loss, grads, _), compiled = loss_and_grads(setup, params, batch)
  return float(loss), grads, compiled, jax.device_get(params)


def _fill(fresh: dict, given: dict) -> dict:
  return {k: _fill(v, given[k]) if isinstance(v, dict) else given.get(k, v) for k, v in fresh.items()}


@pytest.fixture(scope="module")
def bf16(batch):
  return run(experiment("none"), batch, jax.devices()[:1])


def flat(grads) -> np.ndarray:
  """Every gradient but the amax histories' (their 'gradient' is their next value)."""
  def drop(tree):
    return {k: drop(v) if isinstance(v, dict) else v for k, v in tree.items() if k != quantization.HISTORY}
  kept = drop(jax.device_get(grads))
  return np.asarray(ravel_pytree(jax.tree.map(lambda g: np.asarray(g, np.float32), kept))[0])


def relative(a, b) -> float:
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def dots(text: str) -> list[str]:
  """Operand types of every dot in a compiled module: the parameter types of the
  computation each dot sits in, by name."""
  out = []
  for block in text.split("\n\n"):
    lines = block.strip().splitlines()
    if not lines:
      continue
    params = dict(re.findall(r"([\w.]+): (\w+)\[", lines[0]))
    for line in lines:
      if m := re.search(r" dot\(([^)]*)\)", line):
        names = [n.strip().lstrip("%") for n in m.group(1).split(",")]
        out.append("x".join(params.get(n, "?") for n in names))
  return out


@pytest.mark.parametrize("mode", ["int8", "fp8", "fp8_delayed"])
def test_quantized_loss_and_gradients_stay_near_bf16(mode, batch, bf16):
  loss, grads, compiled, _ = run(experiment(mode), batch, jax.devices()[:1], params=bf16[3])
  ref_loss, ref_grads = bf16[0], bf16[1]
  max_loss, max_grad, min_grad = BOUNDS[mode]
  assert abs(loss - ref_loss) / ref_loss < max_loss, (loss, ref_loss)
  change = relative(flat(grads), flat(ref_grads))
  assert min_grad < change < max_grad, f"{mode}: gradients moved by {change:.4f} of their norm"
  if mode == "int8":
    # 2 layers x 7 projections x (forward + 2 backward) = 42 int8 dots (the scan body runs
    # twice; the unrolled count is in the HLO once per body); the logits stay in bf16.
    kinds = dots(compiled.as_text())
    assert kinds.count("s8xs8") >= 21, kinds
    assert any("bf16" in k or "f32" in k for k in kinds), "the logits dot must stay unquantized"


def test_fp8_program_runs_e4m3_forward_and_e5m2_backward_dots(batch):
  """XLA:CPU has no fp8 dot and widens the operands after its own passes, so the 8-bit
  types are read where jax emits them: the lowered program's dot_generals."""
  exp = experiment("fp8")
  setup = setup_for(exp, jax.devices()[:1])
  params = state_lib.init_fn(setup)(jax.random.key(0))["params"]
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    from meshtools import grads_fn
    text = grads_fn(setup).lower(params, batch).as_text()
  operands = re.findall(r"stablehlo.dot_general[^\n]*:\s*\((tensor<[^>]*>), (tensor<[^>]*>)\)", text)
  types = [re.sub(r"tensor<[\dx]*", "", a) + "x" + re.sub(r"tensor<[\dx]*", "", b) for a, b in operands]
  assert types.count("f8E4M3FN>xf8E4M3FN>") >= 7, types      # forward: every projection
  assert any("f8E5M2" in t for t in types), types             # backward: the gradient in e5m2


def test_int8_lm_on_a_2x4_mesh_equals_one_device(batch):
  """The whole LM: equal up to int8 rounding flips. The sharded program computes its f32
  values in another order (1e-7 apart), which moves some values across an int8 rounding
  boundary and, through a token's scale, its whole row (measured 2026-11-25: loss 1.0e-4
  of itself, gradients 1.8% of their norm; int8 against bf16 moves them 2e-4 and 3%). A
  bit-exact layer-level comparison did not hold on XLA:CPU (5% of one projection's
  outputs differ by up to 1%), so this bound is what is shown."""
  one = run(experiment("int8", dtype="float32"), batch, jax.devices()[:1])
  sharded = run(experiment("int8", "2d", (2, 4), ("data", "model"), dtype="float32"), batch,
                params=one[3])
  np.testing.assert_allclose(sharded[0], one[0], rtol=5e-4)
  assert relative(flat(sharded[1]), flat(one[1])) < 0.05


_COLLECTIVE = re.compile(r"= \(?(\w+)\[([\d,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")


def collectives(compiled) -> list[tuple[str, str, str]]:
  """(kind, result dtype, result dims) of every collective of a compiled step."""
  return [(kind, dtype, dims) for dtype, dims, kind in _COLLECTIVE.findall(compiled.as_text())]


_SIZE = {"s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "s32": 4, "f32": 4}


def moved(found) -> int:
  return sum(_SIZE.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d])) for _, dtype, dims in found)


@pytest.mark.parametrize("preset,ici,axes", [("2d", (2, 4), ("data", "model")), ("fsdp", (8,), ("data",))])
def test_no_collective_of_a_quantized_tensor_without_a_bf16_twin(preset, ici, axes, batch):
  """Every 8-bit collective of the int8 step moves a tensor the bf16 step moves too (same
  kind and shape; there in f32, as the master weights are gathered before the cast), and
  the step moves fewer bytes. Under FSDP each weight gather is replaced one for one. Under
  2d the activation gathers before q, k and v are three s8 gathers where bf16 has one f32
  gather (each projection quantizes its input itself): 3 bytes per element instead of 4."""
  base = collectives(run(experiment("none", preset, ici, axes), batch)[2])
  quant = collectives(run(experiment("int8", preset, ici, axes), batch)[2])
  eight_bit = [c for c in quant if c[1] in ("s8", "u8", "f8e4m3fn", "f8e5m2")]
  assert eight_bit, "the int8 step should gather 8-bit weights"
  twins = {(kind, dims) for kind, _, dims in base}
  assert all((kind, dims) in twins for kind, _, dims in eight_bit), (eight_bit, twins)
  assert moved(quant) < moved(base)
  if preset == "fsdp":
    gathers = lambda found, types: sorted(dims for kind, t, dims in found if kind == "all-gather" and t in types)
    assert gathers(quant, ("s8",)) == [d for d in gathers(base, ("f32", "bf16")) if d in gathers(quant, ("s8",))]


def test_delayed_scaling_histories_are_written_by_the_step_not_the_optimizer(batch):
  exp = experiment("fp8_delayed")
  setup = setup_for(exp, jax.devices()[:1])
  state = state_lib.init_fn(setup)(jax.random.key(0))
  step = step_lib.train_step_fn(setup)
  with jax.set_mesh(setup.mesh), use_rules(setup.rules):
    histories = []
    for _ in range(3):
      state, metrics = step(state, batch)
      histories.append(np.asarray(jax.device_get(
          state["params"]["layers"]["blocks"]["mlp"]["down"]["amax_history"])))
  first, second, third = histories        # [layers, 2, 16]
  assert np.all(first[:, :, 0] > 0) and np.all(first[:, :, 1:] == 0)
  np.testing.assert_array_equal(second[:, :, 1], first[:, :, 0])  # pushed back one step
  np.testing.assert_array_equal(third[:, :, 2], first[:, :, 0])
  # The weight's amax (row 1) is the max |W| of the down projection of each layer.
  w = np.asarray(jax.device_get(state["params"]["layers"]["blocks"]["mlp"]["down"]["kernel"]), np.float32)
  assert np.all(third[:, 1, 0] > 0.5 * np.abs(w).reshape(w.shape[0], -1).max(axis=1))
  assert np.isfinite(float(metrics["grad_norm"]))


def test_eight_bit_dots_are_priced_at_their_own_peak():
  """The same matmul's gradient, int8 vs bf16: XLA counts the same FLOPs; the step model
  moves the int8 dots' FLOPs to the chip's int8 peak (v6e: 1836 vs 918 T), so their time
  halves, and on a chip without int8 units (v3) nothing changes."""
  from shardax.perf import hardware, costs, ops
  x = jax.ShapeDtypeStruct((8, 128, 256), jax.numpy.bfloat16)
  w = jax.ShapeDtypeStruct((256, 512), jax.numpy.bfloat16)
  dn = (((2,), (0,)), ((), ()))

  def priced(mode):
    f = lambda x, w: (quantization.dot_general(mode, x, w, dn).astype(np.float32) ** 2).sum()
    return costs.of_compiled(jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w).compile())

  base, q = priced("none"), priced("int8")
  dots8 = [op for p in q.pieces for op in p.ops if op[0] == "xla"]
  matmul = 2.0 * 8 * 128 * 256 * 512
  assert sorted(op[1] for op in dots8) == ["s8", "s8", "s8"]          # forward + 2 backward
  assert sum(op[2] for op in dots8) == pytest.approx(3 * matmul)
  assert q.flops == pytest.approx(base.flops, rel=0.05)               # both count every FLOP once

  def compute(c, chip):
    return sum(p.executions * (ops.seconds("xla", "bf16", p.flops, chip) +
                               sum(ops.seconds(*op, chip) for op in p.ops)) for p in c.pieces)
  v6e, v3 = hardware.CHIPS["TPU v6 lite"], hardware.CHIPS["TPU v3"]
  dot_time = 3 * matmul / (v6e.peak_bf16_flops * ops.efficiency(v6e, "xla"))
  assert compute(base, v6e) - compute(q, v6e) == pytest.approx(dot_time / 2, rel=0.1)
  assert compute(q, v3) == pytest.approx(compute(base, v3), rel=0.1)


def test_plan_ranks_quantization_with_the_layouts():
  """`--mode=plan --plan_quantization=none,int8`: every layout once per choice, each a valid
  --set line (the ranking itself is plan.rank's, tested in test_plan.py)."""
  from shardax.perf import plan
  cfg = configs.get("lm.small")
  grid = plan.Grid(model_axis=(2,), remat=("full",), microbatches=(1,), pipeline_stages=(),
                   quantization=("none", "int8"))
  found = plan.candidates(cfg, 4, grid)
  assert len(found) == 2 * len(plan.candidates(cfg, 4, plan.Grid(model_axis=(2,), remat=("full",),
                                                                   microbatches=(1,), pipeline_stages=())))
  for sets in found:
    cfg = configs.get("lm.small")
    configs.apply_overrides(cfg, sets)
    assert configs.build(cfg).model.quantization in ("none", "int8")
  assert {s[-1] for s in found} == {"model.quantization=none", "model.quantization=int8"}


def test_tpu_convolution_forms_of_8bit_dots_count_only_real_taps():
  """Lines of a v6e:2x2 int8 compile (lm with d_model 256, 4 heads of 64, 1024 tokens per
  chip): the TPU compiler writes the q projection as a window of 4 taps over padding, of
  which one is real, and a weight gradient as a window over the token dim."""
  from shardax.perf import hlo, ops
  q_proj = ['%a = s8[8,128,256,1]{2,1,3,0:T(8,128)(4,1)} fusion(%p), kind=kLoop, calls=%f',
            '%b = s8[256,4,64,1]{0,2,1,3:T(8,128)(4,1)} fusion(%p), kind=kLoop, calls=%f',
            '%c = bf16[8,128,4,64]{1,3,2,0:T(8,128)(2,1)} convolution(%a, %b), window={size=1x4 '
            'pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f']
  w_grad = ['%x = s8[8,128,1024]{2,1,0} fusion(%p), calls=%f', '%y = s8[8,128,256]{2,1,0} fusion(%p), calls=%f',
            '%z = bf16[1024,256,1]{1,0,2} convolution(%x, %y), window={size=8}, dim_labels=0fb_0io->bf0']
  for lines, flops in ((q_proj, 2.0 * 1024 * 256 * 4 * 64), (w_grad, 2.0 * 1024 * 1024 * 256)):
    (found,) = ops.eight_bit_dots(hlo.parse("\n".join(lines)))
    assert found == ("xla", "s8", flops)
