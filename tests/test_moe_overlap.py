"""Which all-to-alls the step model may hide: only an async one (start/done) with matmul
work between its start and its done; a ragged all-to-all costs the rows it sends."""

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
    "  %neg = bf16[64,128]{1,0} negate(%mm)",
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
  assert not got["s2"].is_async        # only a negate: nothing to hide it behind
  assert got["s1"].bytes == got["s2"].bytes and abs(got["s1"].bytes - 64 * 128 * 2) <= 8  # + context


def test_a_ragged_all_to_all_is_an_all_to_all_of_the_rows_it_sends():
  """The dropless exchange (layers/moe_dispatch.py) moves its input rows into a larger
  receive buffer; it was not read as a collective at all, so the step model priced the
  MoE token exchange of moe.mixtral_8x7b / moe.deepseek_v3 at 0."""
  r = next(c for c in report.collectives(HLO) if c.name == "r")
  assert r.kind == "all-to-all" and r.group_size == 4 and not r.is_async
  assert r.bytes == 64 * 128 * 2       # the 64 rows sent, not the 256-row buffer
