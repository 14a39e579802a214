"""Costs of one compiled step that count loops: FLOPs, bytes accessed, collectives.

XLA's `compiled.cost_analysis()` adds up every instruction of the module once, so
the body of a `while` loop (a scan over layers, pipeline iterations, microbatch
accumulation) counts once however many times it runs: an 8-layer scanned model
shows about 1/8 of its real work. Here the module is split at its loops and each
loop body is priced on its own by XLA's own HloCostAnalysis (the same C++ that
`cost_analysis()` runs), then multiplied by its trip count:

  total(c) = own(c) + sum over loops w started in c of trip(w) x (total(body_w) + total(cond_w))
  own(c)   = cost(c as a module) - sum over those loops of (cost(body_w) + cost(cond_w))

so nested loops multiply. Trip counts come from the compiler's `known_trip_count`
or, where the TPU compiler omits it, from the loop condition `i < N`
(perf/hlo/loops.py). A loop whose trip count cannot be read counts once, as before.

Bytes accessed are logical (unpadded) bytes: each loop body is priced by the host
platform's cost analysis with the layouts' tiles and memory spaces taken out
(`{1,0:T(8,128)S(1)}` -> `{1,0}`), so tiny dims are not rounded up to tiles; for
the dims of real models (multiples of 128) the two agree. jaxlib 0.11's cost
analysis prices the tiles it reads in the text (jaxlib 0.10's ignored them): same
HLO, +15% bytes for a small scanned stack, so they are stripped for both.
Collectives come from the HLO with the same loop multipliers (`report.collectives`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax

from shardax.sharding import report
from shardax.perf import hbm, hlo, kernels, ops

_KEYS = ("flops", "transcendentals", "bytes accessed")


@dataclasses.dataclass(frozen=True)
class Loop:
  """One `while` of the program: its body and how often it runs per step."""
  body: str
  trip_count: int
  executions: int          # times the body runs per step (trip count x enclosing loops)
  flops: float             # one iteration of the body, nested loops included
  bytes_accessed: float
  stacked: int = -1        # arrays in the loop state whose leading dim is the trip count (-1: unknown)
  leading: tuple = ()      # (leading dim, arrays of the loop state with it) pairs; () in costs cached before


@dataclasses.dataclass(frozen=True)
class Piece:
  """A computation the program's control flow runs (the entry or a loop body), with what
  it does itself: nested loops excluded, fusions and plain calls included."""
  computation: str
  executions: int
  flops: float
  bytes_accessed: float
  transcendentals: float
  trips: tuple[int, ...] = ()      # trip counts of the loops around it, outermost first
  ops: tuple = ()                  # (kind, dtype, FLOPs): library calls XLA counts as 0, and XLA's own
                                   # 8-bit dots (kind "xla", not in `flops`) (perf/ops.py)
  loops: tuple[str, ...] = ()      # bodies of the loops around it, outermost first
  onchip_bytes: float = 0.0        # of bytes_accessed, what never crosses HBM (perf/hbm.py); 0 in
                                   # costs cached before it was read
  host_bytes: float = 0.0          # moved between device and host memory by async transfers (an
                                   # offload remat policy), on the host link (perf/hbm.py)
  host_sync_bytes: float = 0.0     # the same by synchronous ones
  stacked: tuple = ()              # outside every loop: (L, traffic share, collective share), the shares
                                   # of its HBM traffic and collective bytes in ops on [L, ...] arrays a
                                   # layer loop carries (hbm.stacked_share); () in costs cached before
  matmul_free_bytes: float = 0.0   # of bytes_accessed, the share in kernels that run no matmul
                                   # (perf/kernels.py): a GPU pays it beside its matmuls; 0 in costs
                                   # cached before it was read

  @property
  def hbm_bytes(self) -> float:
    """Bytes one execution moves through HBM: XLA's bytes accessed less on-chip traffic."""
    return self.bytes_accessed - self.onchip_bytes


@dataclasses.dataclass(frozen=True)
class Costs:
  """Per device, per call of the step, every loop body times its trip count."""
  flops: float
  transcendentals: float
  bytes_accessed: float
  collectives: tuple[report.Collective, ...]
  loops: tuple[Loop, ...]
  flops_loop_bodies_once: float    # what `cost_analysis()` says, for comparison
  pieces: tuple[Piece, ...] = ()
  owner: dict = dataclasses.field(default_factory=dict)  # computation -> its Piece's computation

  def piece_of(self, c: report.Collective) -> Piece | None:
    """The entry or loop body a collective runs in."""
    name = self.owner.get(c.computation)
    return next((p for p in self.pieces if p.computation == name), None)

  @property
  def collective_bytes(self) -> float:
    return float(sum(c.bytes * c.executions for c in self.collectives))

  def summary(self) -> dict:
    return {"flops": self.flops, "transcendentals": self.transcendentals,
            "bytes_accessed": self.bytes_accessed, "collective_bytes": self.collective_bytes,
            "flops_loop_bodies_once": self.flops_loop_bodies_once,
            "loops": [dataclasses.asdict(l) for l in self.loops]}


@dataclasses.dataclass
class _Module:
  prefix: str                          # source tables (stack frames) the bodies refer to
  blocks: dict[str, list[str]]         # computation -> its lines, in file order
  entry: str
  callees: dict[str, list[str]]        # computation -> computations it names
  whiles: dict[str, list[tuple[str, str, int]]]  # computation -> (cond, body, trip)
  stacked: dict[str, int] = dataclasses.field(default_factory=dict)  # loop body -> Loop.stacked
  leading: dict[str, tuple] = dataclasses.field(default_factory=dict)  # loop body -> Loop.leading
  records: hlo.Module | None = None    # the parsed module


def _split(hlo_text: str) -> _Module:
  mod = hlo.parse(hlo_text)
  blocks = {name: comp.lines for name, comp in mod.computations.items() if name}
  callees, whiles, stacked, leading = {}, {}, {}, {}
  for name in blocks:
    insts = mod.computations[name].instructions
    # Single calls (calls=, to_apply=, body=, ...) in text order, then the listed ones.
    named = [v for i in insts for k, v in i.attributes.items() if k in hlo.module.CALL_KEYS]
    named += [c for i in insts for k, v in i.attributes.items() if k in hlo.module.CALL_LIST_KEYS
              for c in v.strip("{}").split(",") if c.strip()]
    named = [c.strip().lstrip("%") for c in named]
    callees[name] = [c for c in dict.fromkeys(named) if c in blocks]
  for w in hlo.whiles(mod):
    trip = 1 if w.trip_count is None else w.trip_count
    whiles.setdefault(w.computation, []).append((w.condition, w.body, trip))
    stacked[w.body] = w.stacked(trip)
    dims = collections.Counter(a.dims[0] for a in w.instruction.results if len(a.dims) > 1)
    leading[w.body] = tuple(sorted(dims.items()))
  return _Module(mod.prefix, blocks, mod.entry, callees, whiles, stacked, leading, mod)


def _reachable(mod: _Module, root: str) -> list[str]:
  seen, stack = set(), [root]
  while stack:
    c = stack.pop()
    if c not in seen:
      seen.add(c)
      stack.extend(mod.callees.get(c, ()))
  return [c for c in mod.blocks if c in seen]  # file order: callees before callers


def _standalone(mod: _Module, root: str) -> str:
  """The computation `root` and everything it calls, as a module with `root` as entry."""
  parts = ["HloModule piece", mod.prefix]
  for c in _reachable(mod, root):
    block = list(mod.blocks[c])
    header = block[0].removeprefix("ENTRY ")
    block[0] = ("ENTRY " + header) if c == root else header
    parts.append("\n".join(block))
  return "\n\n".join(parts)


def _cost_client():
  """The client whose XLA cost model prices the HLO: the CPU's where this process has one (the
  figures calibrated against TPU dry runs), else the default backend's (JAX_PLATFORMS=cuda
  leaves a process no CPU client)."""
  try:
    return jax.devices("cpu")[0].client
  except RuntimeError:
    return jax.devices()[0].client


def _xla_cost(text: str) -> dict[str, float]:
  from jax._src.lib import xla_client
  from jaxlib import _hlo
  module = _hlo.hlo_module_from_text(hlo.logical_layouts(text))
  client = _cost_client()
  cost = xla_client._xla.hlo_module_cost_analysis(client, module)
  return {k: float(cost.get(k, 0.0)) for k in _KEYS}


def _loops_started_in(mod: _Module, comp: str) -> list[tuple[str, str, int]]:
  """Loops in `comp` or in what it calls without entering another loop."""
  found, seen, stack = [], set(), [comp]
  while stack:
    c = stack.pop()
    if c in seen:
      continue
    seen.add(c)
    found += mod.whiles.get(c, [])
    bodies = {x for w in mod.whiles.get(c, []) for x in w[:2]}
    stack.extend(x for x in mod.callees.get(c, ()) if x not in bodies)
  return found


def of_hlo_text(hlo_text: str) -> Costs:
  """Loop-aware costs of compiled HLO text (`compiled.as_text()`)."""
  mod = _split(hlo_text)
  whole = functools.lru_cache(None)(lambda c: _xla_cost(_standalone(mod, c)))
  loops: list[Loop] = []
  pieces: list[Piece] = []
  owner: dict[str, str] = {}

  def total(comp: str, runs: int, trips: tuple[int, ...] = (), around: tuple[str, ...] = ()) -> dict[str, float]:
    out = dict(whole(comp))
    started = _loops_started_in(mod, comp)
    own = {k: whole(comp)[k] - sum(whole(b)[k] + whole(c)[k] for c, b, _ in started) for k in _KEYS}
    inside = _inside(mod, comp)
    insts = [i for c in mod.blocks if c in inside for i in mod.records.computations[c].instructions]
    calls = tuple(ops.custom_call_ops(mod.records, insts))
    # 8-bit dots: XLA counted their FLOPs; the piece keeps them apart, at their own rate.
    dots8 = tuple(ops.eight_bit_dots(mod.records, insts))
    onchip = min(own["bytes accessed"], hbm.onchip_bytes(mod.records, inside))
    host = hbm.host_bytes(mod.records, [c for c in mod.blocks if c in inside])
    stacked = () if trips else tuple((d, *hbm.stacked_share(mod.records, [c for c in mod.blocks if c in inside], d))
                                     for d in _layer_dims(mod))
    free = own["bytes accessed"] * kernels.matmul_free_share(mod.records, [c for c in mod.blocks if c in inside])
    pieces.append(Piece(comp, runs, own["flops"] - sum(f for _, _, f in dots8), own["bytes accessed"],
                        own["transcendentals"], trips, calls + dots8, around, onchip, *host, stacked, free))
    for c in inside:
      owner.setdefault(c, comp)
    for cond, body, trip in started:
      inner_body = total(body, runs * trip, trips + (trip,), around + (body,))
      inner_cond = total(cond, runs * trip, trips + (trip,), around + (body,))
      loops.append(Loop(body, trip, runs * trip, inner_body["flops"], inner_body["bytes accessed"],
                        mod.stacked.get(body, -1), mod.leading.get(body, ())))
      for k in _KEYS:
        out[k] += (trip - 1) * whole(body)[k] + (trip - 1) * whole(cond)[k]
        out[k] += trip * ((inner_body[k] - whole(body)[k]) + (inner_cond[k] - whole(cond)[k]))
    return out

  result = total(mod.entry, 1)
  # Library calls are FLOPs XLA did not count; its own ("xla") dots it did.
  result["flops"] += sum(p.executions * sum(f for kind, _, f in p.ops if kind != "xla") for p in pieces)
  return Costs(result["flops"], result["transcendentals"], result["bytes accessed"],
               tuple(report.collectives(hlo_text)), tuple(loops), whole(mod.entry)["flops"],
               tuple(pieces), owner)


def _layer_dims(mod: _Module) -> list[int]:
  """Leading dims that some loop's state carries at least `_MIN_STACKED` arrays of: the depth of
  a scanned stack, if the program has one (its [L, ...] weights, gradients and moments)."""
  return sorted({d for lead in mod.leading.values() for d, n in lead if n >= _MIN_STACKED and d > 1})


def _inside(mod: _Module, comp: str) -> set[str]:
  """Computations run as part of `comp` itself (not inside one of its loops)."""
  seen, stack = set(), [comp]
  while stack:
    c = stack.pop()
    if c in seen:
      continue
    seen.add(c)
    bodies = {x for w in mod.whiles.get(c, []) for x in w[:2]}
    stack.extend(x for x in mod.callees.get(c, ()) if x not in bodies)
  return seen


def of_compiled(compiled) -> Costs:
  """Loop-aware costs of a `jax.jit(...).lower(...).compile()` result."""
  return of_hlo_text(compiled.as_text())


# A layer loop carries the stacked weights (and their gradients, moments) as [L, ...] arrays;
# the TPU compiler's windowed-einsum loops carry 4-5 chunks, whose leading dim may equal L.
_MIN_STACKED = 4
# Iterations of a layer loop the TPU compiler may run outside it (seen: the first backward
# layer of a host-offloading stack, at every depth).
_MAX_PEELED = 2


def layer_loop_trips(costs: Costs, shallow: int) -> dict[str, int]:
  """{body: trip count} of the loops that run once per layer of a `shallow`-layer compile.

  A trip count of `shallow` is not proof (a windowed einsum over a 4-way axis loops 4
  times too), nor is one below it: the TPU compiler may peel a layer loop, running its
  first iteration outside it (the backward loop of a stack that offloads its layer inputs
  to host memory runs L - 1 times, at 3 layers and at 80). A scan over layers carries the
  stacked weights: at least `_MIN_STACKED` arrays of its state have `shallow` as their
  leading dim, and it is not the compiler's windowed einsum. Its trip count is `shallow`,
  or `shallow` less at most `_MAX_PEELED` peeled iterations; then it carries more
  [shallow, ...] arrays than arrays led by its own trip count (a loop over the first dense
  layers of an MoE stack, 2 of them, passes the MoE units' [4, ...] stacks through but
  carries more of its own [2, ...] ones). Costs cached before the state's leading
  dims were read (`leading` empty) fall back to the trip count (and `stacked`, -1 before
  that was read).
  """
  out = {}
  for l in costs.loops:
    if "windowed_dot_general" in l.body:
      continue
    if l.leading:
      carried = dict(l.leading)
      layers, own = carried.get(shallow, 0), carried.get(l.trip_count, 0)
      if l.trip_count == shallow and layers >= _MIN_STACKED:
        out[l.body] = l.trip_count
      elif shallow - _MAX_PEELED <= l.trip_count < shallow and layers >= _MIN_STACKED and layers > own:
        out[l.body] = l.trip_count
    elif l.trip_count == shallow and (l.stacked < 0 or l.stacked >= _MIN_STACKED):
      out[l.body] = l.trip_count
  return out


def layer_loops(costs: Costs, shallow: int) -> set[str]:
  """Bodies of the loops that run once per layer of a `shallow`-layer compile (`layer_loop_trips`)."""
  return set(layer_loop_trips(costs, shallow))


def deepen(costs: Costs, shallow: int, deep: int, outside_scale: float) -> Costs:
  """The costs of the same program with `deep` layers, from a compile with `shallow`.

  A scanned stack makes per-layer costs exactly linear in depth: every piece inside a
  layer loop (`layer_loop_trips`) runs as often as that loop's body does at `deep` layers:
  deep/shallow times as often, or, for a loop whose first iterations the compiler peeled
  (trip t < shallow, the other shallow - t run outside it, at every depth), (deep -
  shallow + t) / t times. Outside every loop, the memory traffic (the optimizer update
  reads and writes every parameter and its moments) and the collectives (gradient
  reductions of the stacked weights) scale by `outside_scale`, the caller's ratio of
  parameter counts; the FLOPs there (embedding, head, loss, a peeled layer: independent of
  depth) do not. Other loops (windowed einsums, accumulation) keep their counts. This is the
  one way a shallow compile is deepened: the calibration (benchmarks/calibrate.py) and
  `--shallow` dry runs (extrapolate.py) both price time with it. Where the costs read which
  part of the entry's traffic is on the stack's [shallow, ...] arrays (`Piece.stacked`), only
  that part grows, by deep/shallow; the embedding, head, loss and a peeled layer stay as
  they are (outside_scale scaled them all: 92% of a 3-layer 70B-shaped entry's traffic is
  the head and loss); its collectives likewise, by the share of their bytes on those arrays.
  """
  trips = layer_loop_trips(costs, shallow)
  factor = {body: (deep - shallow + t) / t for body, t in trips.items()}
  shares = lambda p: next((tuple(x[1:]) for x in p.stacked if x[0] == shallow), None)

  def scale(p: Piece) -> float | None:
    """How much more often piece `p` runs at `deep` layers; None: not in a layer loop."""
    if p.loops:
      return next((factor[b] for b in p.loops if b in factor), None)
    return deep / shallow if shallow in p.trips and factor else None

  pieces = []
  for p in costs.pieces:
    if (f := scale(p)) is not None:
      pieces.append(dataclasses.replace(p, executions=round(p.executions * f)))
    elif not p.trips:  # outside every loop: per-parameter traffic scales, it still runs once
      pieces.append(dataclasses.replace(p, bytes_accessed=p.bytes_accessed * outside_scale,
                                        onchip_bytes=p.onchip_bytes * outside_scale,
                                        matmul_free_bytes=p.matmul_free_bytes * outside_scale)
                    if shares(p) is None else _deepened_outside(p, shares(p)[0], deep / shallow))
    else:
      pieces.append(p)
  by_name = {p.computation: p for p in costs.pieces}
  collectives = []
  for c in costs.collectives:
    p = by_name.get(costs.owner.get(c.computation, ""))
    if p is not None and not p.trips and shares(p) is not None:   # the stack's share grows with depth
      grow = shares(p)[1]
      collectives.append(dataclasses.replace(c, bytes=int(c.bytes * (1 + grow * (deep / shallow - 1)))))
    elif p is None or not p.trips:
      collectives.append(dataclasses.replace(c, bytes=int(c.bytes * outside_scale)))
    elif (f := scale(p)) is not None:
      collectives.append(dataclasses.replace(c, executions=round(c.executions * f)))
    else:
      collectives.append(c)
  total = lambda key: sum(getattr(p, key) * p.executions for p in pieces)
  flops = sum((p.flops + sum(f for _, _, f in p.ops)) * p.executions for p in pieces)
  loops = tuple(dataclasses.replace(l, executions=round(l.executions * factor[l.body]))
                if l.body in factor else l for l in costs.loops)
  return Costs(flops, total("transcendentals"), total("bytes_accessed"), tuple(collectives),
               loops, costs.flops_loop_bodies_once, tuple(pieces), costs.owner)


def _deepened_outside(p: Piece, share: float, layers: float) -> Piece:
  """A piece outside every loop at `layers` times the depth: the share of its traffic in ops on the
  stack's [L, ...] arrays (the optimizer update of the stacked weights and moments, their
  gradients) grows with the depth; the rest (embedding, head and loss, a layer the compiler
  peeled out of its loop) does not. Its HBM bytes (bytes accessed less on-chip) are split so. The
  grown part runs no matmul (an update, a copy into the stack): it adds to `matmul_free_bytes`."""
  grown = p.hbm_bytes * share * (layers - 1)
  return dataclasses.replace(p, bytes_accessed=p.bytes_accessed + grown, matmul_free_bytes=p.matmul_free_bytes + grown)


def to_json(costs: Costs) -> dict:
  """A plain-JSON form of `costs` (cache it; `from_json` gives it back)."""
  return {"flops": costs.flops, "transcendentals": costs.transcendentals,
          "bytes_accessed": costs.bytes_accessed, "flops_loop_bodies_once": costs.flops_loop_bodies_once,
          "collectives": [dataclasses.asdict(c) for c in costs.collectives],
          "loops": [dataclasses.asdict(l) for l in costs.loops],
          "pieces": [dataclasses.asdict(p) for p in costs.pieces], "owner": costs.owner}


def _record(cls, d: dict):
  """`cls(**d)` for a frozen record read back from JSON: every list (JSON has no tuples) is
  made a tuple again, nested ones included, so the record equals the one written and can key
  a dict (the step model indexes by `Collective.loops_between`)."""
  tup = lambda v: tuple(tup(x) for x in v) if isinstance(v, list) else v
  return cls(**{k: tup(v) for k, v in d.items()})


def from_json(d: dict) -> Costs:
  """The `Costs` that `to_json` wrote: equal to it, field for field."""
  return Costs(d["flops"], d["transcendentals"], d["bytes_accessed"],
               tuple(_record(report.Collective, c) for c in d["collectives"]),
               tuple(_record(Loop, l) for l in d["loops"]), d["flops_loop_bodies_once"],
               tuple(_record(Piece, p) for p in d["pieces"]), d["owner"])
