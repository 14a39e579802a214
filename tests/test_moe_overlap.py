"""Which all-to-alls the step model may hide: only an async one (start/done) with matmul
work between its start and its done; a ragged all-to-all costs the rows it sends."""

import pytest

from shardax.sharding import report

A2A = "(({t}), {t}, u32[], u32[]) all-to-all-start(%{x}), channel_id={c}, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}"
HLO = "\n".join([
    "HloModule m, num_partitions=4", "",
    "ENTRY %main (p: bf16[64,128], w: bf16[128,128]) -> bf16[64,128] {",
    "  %p = bf16[64,128]{1,0} parameter(0)",
    "  %w = bf16[128,128]{1,0} parameter(1)",
    "  %s1 = " + A2A.format(t="bf16[64,128]{1,0}", x="p", c=1),
    "  %mm = bf16[64,128]{1,0} convolution(%p, %w), dim_labels=bf_io->bf",
    "  %d1 = bf16[64,128]{1,0} all-to-all-done(%s1)",
    "  %s2 = " + A2A.format(t="bf16[64,128]{1,0}", x="d1", c=2),
    "  %neg = bf16[64,128]{1,0} fusion(%mm), kind=kLoop, calls=%negate_fusion",
    "  %d2 = bf16[64,128]{1,0} all-to-all-done(%s2)",
    "  %buf = bf16[256,128]{1,0} broadcast(bf16[] constant(0)), dimensions={}",
    "  %off = s32[4]{0} constant({0, 16, 32, 48})",
    "  %r = bf16[256,128]{1,0} ragged-all-to-all(%d2, %buf, %off, %off, %off, %off), "
    "channel_id=3, replica_groups={{0,1,2,3}}",
    "  ROOT %out = bf16[64,128]{1,0} slice(%r), slice={[0:64], [0:128]}",
    "}", ""])


def test_only_an_all_to_all_with_a_matmul_in_flight_counts_as_async():
  got = {c.name: c for c in report.collectives(HLO)}
  assert got["s1"].is_async            # the convolution runs between s1 and its done
  assert not got["s2"].is_async        # only an elementwise fusion: no matmul to hide it behind
  assert got["s1"].bytes == got["s2"].bytes and abs(got["s1"].bytes - 64 * 128 * 2) <= 8  # + context


def test_a_ragged_all_to_all_is_an_all_to_all_of_the_rows_it_sends():
  """The dropless exchange (layers/moe_dispatch.py) moves its input rows into a larger
  receive buffer; it was not read as a collective at all, so the step model priced the
  MoE token exchange of moe.mixtral_8x7b / moe.deepseek_v3 at 0."""
  r = next(c for c in report.collectives(HLO) if c.name == "r")
  assert r.kind == "all-to-all" and r.group_size == 4 and not r.is_async
  assert r.bytes == 64 * 128 * 2       # the 64 rows sent, not the 256-row buffer


SCRIPT = """
import json, sys
from shardax import configs
import pytest

from shardax.sharding import report
from shardax.perf import dry_run
cfg = configs.get("moe.tiny")
configs.apply_overrides(cfg, ["data.source='synthetic'", "model.num_layers=2", "model.moe.every=1",
    "model.d_model=256", "model.d_ff=512", "model.moe.d_ff=512", "model.moe.num_experts=4",
    "model.moe.group_size=256", "data.seq_len=256", "model.max_len=256", "train.global_batch=16",
    "model.dtype='bfloat16'", "model.remat='full'", "mesh.topology='v5p:2x2x1'", "mesh.ici=(4,1)",
    "model.moe.dispatch_chunks=" + sys.argv[1]])
_, setup = dry_run.prepare(configs.build(cfg))
hlo = dry_run.compile_step(setup).as_text()
print(json.dumps([c.is_async for c in report.collectives(hlo) if c.kind == "all-to-all"]))
"""


def _a2a_async(chunks: int) -> list[bool]:
  import json
  import os
  import subprocess
  import sys
  env = dict(os.environ, LIBTPU_INIT_ARGS="--xla_tpu_enable_async_all_to_all=true", JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)   # a cached program may predate the flag
  out = subprocess.run([sys.executable, "-c", SCRIPT, str(chunks)], env=env, capture_output=True,
                       text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow   # two TPU compiles in subprocesses (libtpu flags are read once per process)
def test_chunked_capacity_dispatch_overlaps_its_all_to_alls_on_tpu():
  """v5p:2x2x1 with the TPU compiler's async all-to-all on: one piece has all-to-alls with no
  matmul in flight (the dispatch waits for its own tokens); two pieces put every one of
  them over the other piece's matmuls (2026-11-26: 4 of 6 -> 12 of 12)."""
  pytest.importorskip("libtpu")
  one, two = _a2a_async(1), _a2a_async(2)
  assert len(two) == 2 * len(one) == 12
  assert not all(one)
  assert all(two)
