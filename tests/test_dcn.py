"""Multi-granule meshes without the hardware: granule errors, the device-order fallback,
and a two-slice TPU dry run whose DCN collectives are listed apart from ICI."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from shardax.perf.hlo import groups as replica_groups
from shardax.sharding import MeshConfig, make_mesh, mesh as mesh_lib, networks, report, topology

needs_libtpu = pytest.mark.skipif(not topology.available(), reason="needs libtpu (the test extra)")


def test_one_process_is_one_granule_and_the_error_names_the_count():
  kind, groups = mesh_lib.granules(jax.devices())
  assert kind == "host" and len(groups) == 1 and len(groups[0]) == 8
  with pytest.raises(ValueError, match=r"mesh.dcn=\(2, 1\) needs 2 granules \(hosts joined by DCN\), "
                                       r"1 host found"):
    make_mesh(MeshConfig(ici=(1, 4), dcn=(2, 1)))
  assert dict(make_mesh(MeshConfig(ici=(2, 4), dcn=(1, 1))).shape) == {"data": 2, "model": 4}


@needs_libtpu
def test_two_tpu_slices_build_a_hybrid_mesh_with_slices_outermost():
  mesh = make_mesh(MeshConfig(ici=(1, 4), dcn=(2, 1), topology="v5e:2x2"))
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert (slices == [[0] * 4, [1] * 4]).all()   # the data axis is the DCN axis
  with pytest.raises(ValueError, match="needs 3 granules .slices joined by DCN., 2 slices found"):
    make_mesh(MeshConfig(ici=(1, 4), dcn=(3, 1)), devices=topology.devices("v5e:2x2", 2))


@needs_libtpu
def test_a_mesh_that_ignores_the_torus_warns(monkeypatch):
  """v5e:4x4 cannot be laid out as (8, 2) along its torus: plain order, but never silently."""
  warned = []
  monkeypatch.setattr(mesh_lib.logging, "warning", lambda msg, *a: warned.append(msg % a))
  devices = topology.devices("v5e:4x4")
  mesh = make_mesh(MeshConfig(ici=(8, 2)), devices=devices)
  assert list(mesh.devices.flat) == list(devices)
  assert len(warned) == 1 and "does not fit the physical layout" in warned[0] and "(8, 2)" in warned[0]
  warned.clear()
  make_mesh(MeshConfig(ici=(4, 4)), devices=devices)
  assert not warned



@needs_libtpu
def test_two_slices_that_ignore_the_torus_warn_and_keep_slices_outermost(monkeypatch):
  """Two v5e:4x4 slices with ici (8, 2): each slice in plain order, slices still outermost."""
  warned = []
  monkeypatch.setattr(mesh_lib.logging, "warning", lambda msg, *a: warned.append(msg % a))
  devices = topology.devices("v5e:4x4", 2)
  mesh = make_mesh(MeshConfig(ici=(8, 2), dcn=(2, 1)), devices=devices)
  assert mesh.devices.shape == (16, 2)
  assert len(warned) == 1 and "does not fit the physical layout" in warned[0]
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert (slices[:8] == 0).all() and (slices[8:] == 1).all()   # the data axis crosses DCN once
  first = [d for d in devices if d.slice_index == 0]
  assert list(mesh.devices[:8].flat) == first                  # plain order within a slice

def _reduction_hlo(mesh, axis: int, out_spec) -> str:
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
  return jax.jit(lambda a: a.sum(axis), out_shardings=NamedSharding(mesh, out_spec)).lower(x).compile().as_text()


@pytest.mark.parametrize("axis, out_spec, crossing_hosts", [
    (0, P("model"), [0, 0, 0, 0, 1, 1, 1, 1]),   # a sum over `data` crosses hosts that split `data`
    (1, P("data"), [0, 1, 2, 3, 0, 1, 2, 3]),    # a sum over `model` crosses hosts that split `model`
])
def test_collectives_whose_groups_span_granules_cross_dcn(axis, out_spec, crossing_hosts):
  """Real compiled CPU HLO on a (2, 4) mesh, read with different device -> host assignments."""
  mesh = make_mesh(MeshConfig(ici=(2, 4)))
  hlo = _reduction_hlo(mesh, axis, out_spec)
  found = report.collectives(hlo)
  assert [c.kind for c in found] == ["all-reduce"]
  assert networks.classify(hlo, [0] * 8, found)["dcn"] == {}
  assert networks.classify(hlo, crossing_hosts, found)["dcn"]["all-reduce"]["count"] == 1
  other = [0, 1, 2, 3, 0, 1, 2, 3] if axis == 0 else [0, 0, 0, 0, 1, 1, 1, 1]
  assert networks.classify(hlo, other, found)["dcn"] == {}   # the reduction stays inside each host


def test_replica_group_forms():
  assert replica_groups.groups("replica_groups=[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert replica_groups.groups("replica_groups=[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert replica_groups.groups("replica_groups={{0,2},{1,3}}, x", 4) == [[0, 2], [1, 3]]
  assert replica_groups.groups("source_target_pairs={{0,1},{1,0}}", 2) == [[0, 1], [1, 0]]
  assert replica_groups.groups("replica_groups={}", 4) == [[0, 1, 2, 3]]
  assert replica_groups.groups("replica_groups=mesh['a'=2,'b'=4] {'a'}, x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert replica_groups.groups("replica_groups=mesh['a'=2,'b'=4] {'b'}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
  # with the mesh's own device order: device i of the mesh is entry i of iota([4,2]).T
  assert replica_groups.groups("replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'a'}, x",
                                 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
  # ... and report.collectives keeps that form whole, so the step model routes the right group
  line = ("%ar = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['a'=2,'b'=4], "
          "device_ids=([4,2]T(1,0)) {'a'}, use_global_device_ids=true, to_apply=%add")
  [c] = report.collectives(f"ENTRY %main (x: f32[8]) -> f32[8] {{\n  {line}\n}}\n")
  assert c.group_size == 2 and replica_groups.groups(c.replica_groups, 8)[0] == [0, 1]


@needs_libtpu
def test_dry_run_of_two_tpu_slices_lists_dcn_collectives(tmp_path):
  import clitools as cli
  from shardax import configs
  from shardax.perf import dry_run
  cfg = configs.get("lm.tiny")
  configs.apply_overrides(cfg, [*cli.TINY, "mesh.topology='v5e:2x2'", "mesh.dcn=(2, 1)", "mesh.ici=(1, 4)",
                                "sharding.preset='2d'"])
  r = dry_run.dry_run(configs.build(cfg), str(tmp_path))
  assert r["mesh"] == {"data": 2, "model": 4} and r["num_devices"] == 8
  dcn, ici = r["networks"]["dcn"], r["networks"]["ici"]
  assert dcn.get("all-reduce", {}).get("bytes", 0) > 0   # gradients are summed across the slices
  assert ici and set(ici) <= set(r["collectives"])
  text = dry_run.format_report(r)
  assert "over DCN: " in text and "over ICI: " in text


# ---- every byte priced on the link it crosses -------------------------------------------

# A cross-slice gradient all-reduce as the TPU compiler writes it for two v5e:2x2 slices
# (copied from a compiled lm.tiny step; the buffer enlarged to 64 MiB of f32).
_MEGASCALE_SEND = (
    '  %send.11 = (f32[16,1024,1024]{2,1,0:T(1,128)}, u32[], token[]) send(%bitcast.8, %after-all.11), '
    'channel_id=25, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
    '"xla_megascale_runtime",_xla_host_transfer_rendezvous="all-reduce.41_0",_xla_megascale_reduce_operation='
    '"SUM",_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}')


class _Dev:
  """A device as links/mesh read it (no GPU here): platform, process, place."""
  def __init__(self, id, process_index, platform="gpu"):
    self.id, self.process_index, self.platform, self.device_kind = id, process_index, platform, "NVIDIA H100 80GB HBM3"


class _Mesh:
  def __init__(self, devices, axis_names):
    self.devices, self.axis_names, self.size = devices, axis_names, devices.size


def _costs(collectives):
  from shardax.perf import costs as costs_lib
  piece = costs_lib.Piece("main", 1, 0.0, 0.0, 0.0)
  return costs_lib.Costs(0.0, 0.0, 0.0, tuple(collectives), (), 0.0, (piece,), {"main": "main"})


def test_a_megascale_send_is_a_dcn_all_reduce_priced_at_the_chips_dcn_bandwidth():
  from shardax.perf import hardware, links, stepmodel
  hlo = f"ENTRY %main.1 (p: f32[4]) -> f32[4] {{\n{_MEGASCALE_SEND}\n}}\n"
  [c] = report.collectives(hlo)
  assert (c.kind, c.link, c.span, c.bytes) == ("all-reduce", "dcn", 2, 64 * 2**20)
  chip = hardware.lookup("TPU v5 lite")
  devices = np.array(topology.devices("v5e:2x2", 2) if topology.available() else [_Dev(i, 0) for i in range(8)])
  times = stepmodel._collective_times(_costs([c]), _Mesh(devices.reshape(2, 4), ("data", "model")), chip)
  want = 2 * c.bytes * (2 - 1) / 2 / chip.dcn_bandwidth + links.DCN_LATENCY   # ring all-reduce, 2 slices
  assert set(times["by_link"]) == {"dcn"}
  assert times["by_link"]["dcn"] == pytest.approx(want, rel=0.01)
  assert times["sync"]["main"] == pytest.approx(want, rel=0.01)   # exposed, not hidden


@needs_libtpu
def test_a_data_all_reduce_over_four_slices_spans_four():
  """The compiler names the slices of a cross-slice all-reduce in a quoted target,
  `"{1,2,3,4}x{0:3}"`; read past its quote it fell back to 2 slices, pricing a 4-slice
  reduction as a 2-slice one (half its DCN traffic per chip)."""
  mesh = make_mesh(MeshConfig(ici=(1, 4), dcn=(4, 1), topology="v5e:2x2"), devices=topology.devices("v5e:2x2", 4))
  x = jax.ShapeDtypeStruct((16, 256), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
  text = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x).compile().as_text()
  assert '_xla_megascale_target="{1,2,3,4}x{0:3}"' in text
  dcn = [c for c in report.collectives(text) if c.link == "dcn"]
  assert [(c.kind, c.span, c.group_size, c.bytes) for c in dcn] == [("all-reduce", 4, 4, 256 * 4)]


def _shift(name: str, pairs: str, rendezvous: str) -> tuple[str, str]:
  """A megascale one-to-one send of %buf and its recv (as the TPU compiler writes a pipeline's
  stage shift between v5p slices; lm.gpt3_175b_4slices on v5p:4x4x8, 2026-11-26)."""
  attrs = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
           f'_xla_host_transfer_rendezvous="{rendezvous}",_xla_megascale_target="{pairs}",'
           '_xla_megascale_transfer_type="ONE_TO_ONE"}')
  return (f"  %send.{name} = (bf16[4,2048,3072]{{2,1,0}}, u32[], token[]) send(%buf, %after-all.{name}), {attrs}",
          f"  %recv.{name} = (bf16[4,2048,3072]{{2,1,0}}, u32[], token[]) recv(%after-all.{name}), {attrs}")


_DOT = "  %{0} = bf16[4096,3072]{{1,0}} convolution(%a, %b), dim_labels=bf_io->bf"
_ADD = "  %{0} = bf16[4,2048,3072]{{2,1,0}} add(%buf, %buf)"


def _program(body: list[str]) -> str:
  return "ENTRY %main.1 (buf: bf16[4,2048,3072]) -> bf16[4,2048,3072] {\n" + "\n".join(body) + "\n}\n"


def test_a_cyclic_shift_split_into_sends_from_disjoint_slices_is_one_transfer():
  """The runtime writes a shift around 4 slices as two sends of the same buffer (slices 1-3 to
  their next, slice 4 to slice 1): every chip sends once, so it is one transfer, not two."""
  a, ra = _shift("1", "{{100000->200000},{200000->300000},{300000->400000}}", "collective-permute.5_0")
  b, rb = _shift("2", "{{400000->100000}}", "collective-permute.6_0")
  c, rc = _shift("3", "{{100001->200001}}", "collective-permute.7_0")   # the same slices again: another
  dcn = [x for x in report.collectives(_program([a, b, ra, rb])) if x.link == "dcn"]
  assert [(x.kind, x.bytes) for x in dcn] == [("collective-permute", 4 * 2048 * 3072 * 2)]
  assert len([x for x in report.collectives(_program([a, c, ra, rc])) if x.link == "dcn"]) == 2


def test_a_dcn_transfer_with_matmuls_between_its_sends_and_dones_is_hidden():
  """Counted as overlapped only when the schedule puts matmul work between the send and its
  done and between the recv and its done; elementwise work alone, or none, leaves it exposed."""
  from shardax.perf import hardware, stepmodel
  send, recv = _shift("1", "{{100000->200000},{200000->100000}}", "collective-permute.5_0")
  dones = ["  %send-done.1 = token[] send-done(%send.1), is_host_transfer=true",
           "  %recv-done.1 = (bf16[4,2048,3072]{2,1,0}, token[]) recv-done(%recv.1), is_host_transfer=true"]
  chip = hardware.lookup("TPU v5")
  devices = np.array(topology.devices("v5p:2x2x1", 2) if topology.available() else [_Dev(i, 0) for i in range(8)])
  mesh = _Mesh(devices.reshape(2, 4), ("stage", "data"))
  for between, hidden in (([_DOT.format("dot.1")], True), ([_ADD.format("add.1")], False), ([], False),
                          ([dones[0], _DOT.format("dot.1"), dones[1]], False)):   # recv waits with no matmul
    body = [send, recv] + between + ([] if len(between) == 3 else dones)
    [c] = [x for x in report.collectives(_program(body)) if x.link == "dcn"]
    assert c.is_async == hidden and (c.compute_between > 0) == hidden, between
    times = stepmodel._collective_times(_costs([c]), mesh, chip)
    assert bool(times["async"]["main"]) == hidden and bool(times["sync"]["main"]) != hidden, between


def test_a_dcn_transfer_a_tpu_program_hides_is_exposed_when_the_program_stands_in_for_gpus():
  """The TPU compiler overlaps a cross-slice transfer with the matmuls between its send and done
  because the TPU runtime moves it beside the TensorCores; priced as H100s (a stand-in) the same
  transfer is an NCCL all-reduce on the GPUs' own SMs, which the TPU schedule says nothing about:
  exposed (an upper bound)."""
  from shardax.perf import hardware, stepmodel
  send, recv = _shift("1", "{{100000->200000},{200000->100000}}", "collective-permute.5_0")
  dones = ["  %send-done.1 = token[] send-done(%send.1), is_host_transfer=true",
           "  %recv-done.1 = (bf16[4,2048,3072]{2,1,0}, token[]) recv-done(%recv.1), is_host_transfer=true"]
  [c] = [x for x in report.collectives(_program([send, recv, _DOT.format("dot.1")] + dones)) if x.link == "dcn"]
  devices = np.array(topology.devices("v5p:2x2x1", 2) if topology.available() else [_Dev(i, 0) for i in range(8)])
  mesh = _Mesh(devices.reshape(2, 4), ("stage", "data"))
  for kind, hidden in (("TPU v5", True), ("NVIDIA H100 80GB HBM3", False)):
    times = stepmodel._collective_times(_costs([c]), mesh, hardware.lookup(kind))
    assert bool(times["async"]["main"]) == hidden and bool(times["sync"]["main"]) != hidden, kind


def test_an_all_reduce_over_two_gpu_hosts_crosses_nvlink_and_the_network():
  """2 hosts x 8 GPUs (one process per GPU: a host is still the granule), one all-reduce of all 16."""
  from shardax.perf import hardware, links, stepmodel
  devices = np.array([_Dev(i, i) for i in range(16)])
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("SHARDAX_PROCESSES_PER_HOST", "8")
    assert [mesh_lib.granule_of(d) for d in devices] == [0] * 8 + [1] * 8
    line = "%ar = f32[8192,1024]{1,0} all-reduce(%g), replica_groups=[1,16]<=[16], to_apply=%add"
    [c] = report.collectives(f"ENTRY %main.1 (g: f32[8192,1024]) -> f32[8192,1024] {{\n  {line}\n}}\n")
    r = links.route(devices, ("data",), links.first_group(c.replica_groups, 16))
    assert (r.size, r.ici_size, r.dcn_size) == (16, 8, 2)
    chip = hardware.lookup("NVIDIA H100 80GB HBM3")
    times = stepmodel._collective_times(_costs([c]), _Mesh(devices, ("data",)), chip)
    ici = 2 * c.bytes * 7 / 8 / chip.ici_link_bandwidth + links.ICI_LATENCY   # NVLink inside each host
    dcn = 2 * c.bytes / 8 * 1 / 2 / chip.dcn_bandwidth + links.DCN_LATENCY    # 1/8 of it between hosts
    assert times["by_link"]["ici"] == pytest.approx(ici, rel=0.01)
    assert times["by_link"]["dcn"] == pytest.approx(dcn, rel=0.02)
  # one process per host (the default): the same 16 processes are 16 hosts
  assert len({mesh_lib.granule_of(d) for d in devices}) == 16


def test_a_named_cluster_network_prices_the_inter_host_part_at_its_bandwidth():
  """The same 2 x 8 all-reduce on A3 High (4 x 200 Gbps NICs per 8 GPUs) and on an InfiniBand
  NDR cluster (400 Gb/s per GPU): NVLink time the same, network time 4x shorter."""
  from shardax.perf import hardware, links, stepmodel
  devices = np.array([_Dev(i, i // 8) for i in range(16)])
  line = "%ar = f32[8192,1024]{1,0} all-reduce(%g), replica_groups=[1,16]<=[16], to_apply=%add"
  [c] = report.collectives(f"ENTRY %main.1 (g: f32[8192,1024]) -> f32[8192,1024] {{\n  {line}\n}}\n")
  kind = "NVIDIA H100 80GB HBM3"
  assert hardware.lookup(kind, "a3-high").dcn_bandwidth == hardware.lookup(kind).dcn_bandwidth == 12.5e9
  a3, ib = (stepmodel._collective_times(_costs([c]), _Mesh(devices, ("data",)), hardware.lookup(kind, net))["by_link"]
            for net in ("a3-high", "infiniband-ndr"))
  assert a3["ici"] == pytest.approx(ib["ici"])
  latency = links.DCN_LATENCY
  assert (a3["dcn"] - latency) == pytest.approx(4 * (ib["dcn"] - latency), rel=1e-6)
  with pytest.raises(ValueError, match="mesh.network='a3'.*a3-high"):
    MeshConfig(network="a3")


_WIDE = ["model.num_layers=2", "model.d_model=1024", "model.num_heads=8", "model.d_ff=4096",
         "model.vocab_size=1024", "model.max_len=128", "data.seq_len=128", "train.global_batch=16",
         "data.source='synthetic'", "sharding.preset='dp'"]


@needs_libtpu
@pytest.mark.slow
def test_data_over_dcn_is_slower_than_one_slice_by_its_gradient_all_reduce():
  """Two v5e:2x2 slices (data over DCN) vs one v5e:2x4 slice, the same 8 chips, data parallel."""
  from shardax import configs
  from shardax.perf import hardware, dry_run
  def run(*sets):
    cfg = configs.get("lm.tiny")
    configs.apply_overrides(cfg, _WIDE + list(sets))
    return dry_run.dry_run(configs.build(cfg))
  two = run("mesh.topology='v5e:2x2'", "mesh.dcn=(2, 1)", "mesh.ici=(4, 1)")
  one = run("mesh.topology='v5e:2x4'", "mesh.ici=(8, 1)")
  by_link = two["predicted"]["breakdown"]["collectives"]["by_link"]
  assert set(by_link) == {"ici", "dcn"} and "dcn" not in one["predicted"]["breakdown"]["collectives"]["by_link"]
  grads = one["collectives"]["all-reduce"]["bytes"]    # one slice, data parallel: the f32 gradients
  bw = hardware.lookup("TPU v5 lite").dcn_bandwidth
  # a hierarchical all-reduce moves 1/4 (the ICI part first) of the gradients over DCN, at least
  assert grads / 4 / bw <= by_link["dcn"] <= 2 * grads / bw
  extra = two["predicted"]["step_seconds"] - one["predicted"]["step_seconds"]
  assert extra == pytest.approx(by_link["dcn"], rel=0.3)
  assert two["networks"]["dcn"]["all-reduce"]["bytes"] >= grads / 4
  assert "over DCN: " in dry_run.format_report(two)


def test_processes_per_host_comes_from_the_launcher(monkeypatch):
  for var in mesh_lib._LOCAL_SIZE_VARS:
    monkeypatch.delenv(var, raising=False)
  assert mesh_lib.processes_per_host() == 1
  monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")     # 8 tasks on each of 2 nodes
  assert mesh_lib.processes_per_host() == 8
  monkeypatch.setenv("SHARDAX_PROCESSES_PER_HOST", "4")    # ours wins
  assert mesh_lib.processes_per_host() == 4
