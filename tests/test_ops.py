"""Programs priced by what they run: GPU library calls get FLOPs from their operands
(perf/ops.py), and the step model prices them at their own measured efficiency."""

import pytest

from shardax.perf import hardware, costs, ops

# A GPU program as XLA prints it after compiling (operands named, not shaped): a cuBLAS
# GEMM [1024, 4096] x [4096, 2048] and cuDNN flash attention forward and backward on
# Q, K, V of [B=2, S=1024, H=8, D=128] with a causal mask.
_ATTN_DIMS = ('"bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],'
              '"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]},"mask_type":"CAUSAL"')
GPU_HLO = f"""HloModule jit_step, num_partitions=1

ENTRY %main.1 (x: bf16[1024,4096], w: bf16[4096,2048], q: bf16[2,1024,8,128], k: bf16[2,1024,8,128], v: bf16[2,1024,8,128]) -> (bf16[1024,2048], bf16[2,1024,8,128], bf16[2,1024,8,128]) {{
  %x = bf16[1024,4096]{{1,0}} parameter(0)
  %w = bf16[4096,2048]{{1,0}} parameter(1)
  %q = bf16[2,1024,8,128]{{3,2,1,0}} parameter(2)
  %k = bf16[2,1024,8,128]{{3,2,1,0}} parameter(3)
  %v = bf16[2,1024,8,128]{{3,2,1,0}} parameter(4)
  %gemm = (bf16[1024,2048]{{1,0}}, s8[4194304]{{0}}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={{"operation_queue_id":"0","gemm_backend_config":{{"alpha_real":1,"beta":0,"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}},"epilogue":"DEFAULT"}}}}
  %y = bf16[1024,2048]{{1,0}} get-tuple-element(%gemm), index=0
  %fwd = (bf16[2,1024,8,128]{{3,2,1,0}}, f32[2,8,1024]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={{bf16[2,1024,8,128]{{3,2,1,0}}, bf16[2,1024,8,128]{{3,2,1,0}}, bf16[2,1024,8,128]{{3,2,1,0}}}}, api_version=API_VERSION_STATUS_RETURNING, backend_config={{"cudnn_fmha_backend_config":{{{_ATTN_DIMS}}}}}
  %o = bf16[2,1024,8,128]{{3,2,1,0}} get-tuple-element(%fwd), index=0
  %bwd = (bf16[2,1024,8,128]{{3,2,1,0}}, bf16[2,1024,8,128]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={{"cudnn_fmha_backend_config":{{{_ATTN_DIMS.replace("bmm1_dot", "bmm1_grad_gemm1_dot")}}}}}
  %dq = bf16[2,1024,8,128]{{3,2,1,0}} get-tuple-element(%bwd), index=0
  ROOT %t = (bf16[1024,2048]{{1,0}}, bf16[2,1024,8,128]{{3,2,1,0}}, bf16[2,1024,8,128]{{3,2,1,0}}) tuple(%y, %o, %dq)
}}
"""
GEMM = 2.0 * 1024 * 2048 * 4096
ATTN_FWD = 4.0 * (2 * 8) * 1024 * 1024 * 128 / 2      # causal: half the scores


def test_library_calls_get_their_flops_from_their_operands():
  c = costs.of_hlo_text(GPU_HLO)
  [entry] = c.pieces
  assert sorted(entry.ops) == sorted([("gemm", "bf16", GEMM), ("attention", "bf16", ATTN_FWD),
                                      ("attention", "bf16", 2.5 * ATTN_FWD)])
  assert c.flops == pytest.approx(entry.flops + GEMM + 3.5 * ATTN_FWD)   # XLA itself counts none of them
  assert costs.from_json(costs.to_json(c)).pieces[0].ops == entry.ops


def test_each_op_is_priced_at_its_kinds_efficiency():
  h100 = hardware.lookup("NVIDIA H100 80GB HBM3")
  assert ops.seconds("gemm", "bf16", GEMM, h100) == pytest.approx(GEMM / (989e12 * 0.73))
  assert ops.seconds("attention", "bf16", ATTN_FWD, h100) == pytest.approx(ATTN_FWD / (989e12 * 0.28))
  v5e = hardware.lookup("TPU v5 lite")
  assert ops.seconds("xla", "bf16", GEMM, v5e) == pytest.approx(GEMM / (197e12 * 0.8))


def test_every_8bit_type_of_the_dtype_table_runs_on_its_own_units():
  h100 = hardware.lookup("NVIDIA H100 80GB HBM3")
  assert h100.peak_fp8_flops > h100.peak_bf16_flops
  for dtype in ("f8e4m3fn", "f8e5m2", "f8e3m4", "f8e8m0fnu"):
    assert ops.peak(h100, dtype) == h100.peak_fp8_flops, dtype
  assert ops.peak(h100, "s8") == h100.peak_int8_flops and ops.peak(h100, "f32") == h100.peak_bf16_flops


def test_a_gpu_step_is_priced_with_its_library_calls():
  """The step model's compute of the program above: 0 without the custom calls."""
  from shardax.perf import stepmodel

  class Exp:  # only what from_costs reads
    class model:
      flops_per_example = staticmethod(lambda data: 0.0)
      tokens_per_example = staticmethod(lambda data: 1)
    data, train = None, type("T", (), {"global_batch": 1})

  class Mesh:
    size, devices, axis_names = 1, None, ()

  h100 = hardware.lookup("NVIDIA H100 80GB HBM3")
  p = stepmodel.from_costs(costs.of_hlo_text(GPU_HLO), Mesh, Exp, h100)
  want = GEMM / (989e12 * 0.73) + 3.5 * ATTN_FWD / (989e12 * 0.28)
  assert p.breakdown["compute_seconds"] == pytest.approx(want, rel=0.01)


def test_a_kernel_the_cost_analysis_misses_is_priced_like_the_cudnn_calls_above():
  """stepmodel.flash_kernel_seconds (a Pallas kernel, or a TPU program standing in for a GPU
  one) for the attention of GPU_HLO (B 2, S 1024, H 8, D 128, causal, no remat) on an H100:
  the same seconds as the cuDNN forward + backward calls priced from the program."""
  from types import SimpleNamespace as NS

  from shardax.perf import stepmodel
  h100 = hardware.lookup("NVIDIA H100 80GB HBM3")
  exp = NS(model=NS(num_layers=1, num_heads=8, dim_per_head=128, remat="none"), data=NS(seq_len=1024),
           train=NS(global_batch=2))
  calls = sum(ops.seconds(*op, h100) for op in costs.of_hlo_text(GPU_HLO).pieces[0].ops if op[0] == "attention")
  assert stepmodel.flash_kernel_seconds(exp, 1, h100) == pytest.approx(calls)
  exp.model.remat = "full"   # the rematerialized forward once more
  assert stepmodel.flash_kernel_seconds(exp, 1, h100) == pytest.approx(calls * 4.5 / 3.5)


def test_a_program_priced_as_another_chip_says_so_first():
  """A TPU program timed as an H100 (the calibration's GPU rows): the first line says so."""
  from shardax.perf import step_report, stepmodel
  import numpy as np

  class Dev:
    device_kind = "TPU v5"

  class Mesh:
    size, devices, axis_names = 1, np.array([Dev()]), ("data",)

  class Exp:
    class model:
      flops_per_example = staticmethod(lambda data: GEMM)   # what the program's GEMM does (no more:
      tokens_per_example = staticmethod(lambda data: 1)      # a step under its roofline is refused)
    data, train = None, type("T", (), {"global_batch": 1})

  c = costs.of_hlo_text(GPU_HLO)
  p = stepmodel.from_costs(c, Mesh, Exp, hardware.lookup("NVIDIA H100 80GB HBM3"))
  assert p.stand_in_for == "TPU v5"
  assert step_report.format_prediction(p)[0].startswith("STAND-IN: this program was compiled for TPU v5")
  same = stepmodel.from_costs(c, Mesh, Exp, hardware.lookup("TPU v5"))
  assert same.stand_in_for == "" and not step_report.format_prediction(same)[0].startswith("STAND-IN")
