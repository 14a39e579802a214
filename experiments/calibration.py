"""Published training runs rebuilt as shardax experiments, to check the step-time model.

`from_row(row)` turns one row of a published-runs table (the schema of
`published-runs/calibration.json`: hardware, model, training, sharding) into an
experiment config for the same model, batch, mesh, remat and dtypes on the same TPU
topology. Where shardax cannot say what the original ran, `approximations(row)`
lists what it does instead; docs/results/calibration.md shows them next to each row:

  * positions: RoPE stands in for T5 relative position biases (a [heads, S, S] bias
    add per layer: no matmul, a little memory traffic);
  * attention (`attention(row)`): a TPU row's Pallas flash / splash kernel is shardax's
    `model.attention='flash'` (the splash kernel); a GPU row's cuDNN / TransformerEngine
    flash attention is `'fused'` (jax.nn.dot_product_attention, cuDNN on a GPU; on the
    TPU stand-in compile below it lowers to XLA attention, which computes every score);
    plain XLA attention, and anything unrecognized, is `'xla'`;
  * remat: MaxText "minimal" / "minimal_flash" (save the projections, recompute
    attention scores) is shardax's dots_no_batch; its host-offload policies
    (qkv_proj_offloaded, minimal_offloaded, decoder-layer-input offload) are `'offload_proj'`
    / `'offload'`; Lingvo's default is taken as full;
  * MoE rows: experts per token -> `moe.top_k`; a capacity implementation (with its
    capacity factor) -> `moe.dispatch='capacity'` (GShard's top-2 only), dropless /
    megablox / ragged -> `'dropless'`; shared experts -> `moe.num_shared_experts`;
  * optimizer: AdamW everywhere (Lingvo used factored Adafactor: less state and
    update traffic; the update is a small part of a step);
  * GPU rows: there is no GPU compiler for a machine we do not have, so the program
    is compiled for a TPU v5p topology with the same devices per node (8 per VM as
    one 2x2x2 slice, VMs as slices) and timed with the H100 figures: same
    partitioning and collectives, the TPU compiler's fusion and scheduling choices.
"""

from __future__ import annotations

import math

from shardax.configs.moe import MoEConfig
from shardax.configs.data import DataConfig
from shardax.configs.schema import ShardingConfig, TrainConfig, TransformerConfig
from shardax.experiments.recipes import experiment_of
from shardax.sharding import MeshConfig

_GEN = {"TPU v3": "v3", "TPU v4": "v4", "TPU v5p": "v5p", "TPU v5e": "v5e", "TPU v6e": "v6e",
        "TPU7x": "tpu7x", "TPU v7x": "tpu7x", "TPU v7": "tpu7x", "Ironwood": "tpu7x"}
# MaxText / Pax remat policies -> the shardax policy that recomputes about as much: "minimal"
# and the with-context variants save every projection (recompute the attention scores:
# dots_no_batch); the save-qkv/out-proj and except-MLP policies recompute the MLP, most of a
# layer's FLOPs (full); "none" saves everything. The offload policies move saved tensors to
# host memory: the q/k/v projections (qkv_proj_offloaded) or every projection
# (minimal_offloaded) is shardax's offload_proj (block input + attention projections on the
# host, the MLP recomputed); a decoder-layer-input offload is offload. Any other policy that
# names offloading is taken as offload, anything else as full, and said so.
_REMAT = {"full": "full", "minimal": "dots_no_batch", "minimal_flash": "dots_no_batch",
          "minimal_with_context": "dots_no_batch", "save_dot_with_context_except_mlp": "full",
          "save_dot_except_mlpwi": "full", "save_dot_except_mlp": "full", "save_qkv_proj": "full",
          "save_out_proj": "full", "qkv_proj_offloaded": "offload_proj",
          "minimal_offloaded": "offload_proj", "offload_proj": "offload_proj",
          "decoder_layer_input_offloaded": "offload", "offload": "offload", "dots": "dots",
          "none": "none", "no_remat": "none", "nothing_saveable": "full"}


def is_gpu(row: dict) -> bool:
  return row["hardware"]["accelerator"].startswith("NVIDIA")


def gpu_kind(row: dict) -> str:
  """The chip-table name of a GPU row's accelerator ("NVIDIA H100 80GB (A3)" -> the H100 row)."""
  from shardax.perf import hardware
  accelerator = row["hardware"]["accelerator"].split(" (")[0]
  chip = hardware.lookup(accelerator)
  if chip is None:
    raise Unexpressible(f"row {row['id']}: hardware.accelerator={accelerator!r} is not in the chip table "
                        f"(perf/hardware.py); add its datasheet figures there")
  return chip.name


# A GPU row's stand-in compile partitions its matmuls as XLA:GPU does by default: the TPU
# compiler's windowed einsums (an FSDP gather split into chunks under a loop of partial matmuls)
# off, a whole all-gather then one GEMM instead (XLA:GPU's own windowed einsum is off below
# xla_gpu_threshold_for_windowed_einsum_mib, and no A3 row's script lowers it).
GPU_STAND_IN_LIBTPU_FLAGS = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false",
                             "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")


def libtpu_flags(row: dict) -> tuple[str, ...]:
  """The libtpu flags a row compiles with: the published run's (`training.libtpu_flags`), and a
  GPU row's stand-in flags (GPU_STAND_IN_LIBTPU_FLAGS)."""
  return tuple(row["training"].get("libtpu_flags") or ()) + (GPU_STAND_IN_LIBTPU_FLAGS if is_gpu(row) else ())


# Words in a GPU row's hardware description -> the cluster network (hardware.NETWORKS), first match.
_NETWORK_WORDS = (("mega", "a3-mega"), ("ultra", "a3-ultra"), ("a4", "a4"), ("infiniband", "infiniband-ndr"),
                  ("dgx", "infiniband-ndr"), ("a3", "a3-high"))


def gpu_network(row: dict) -> str | None:
  """The cluster network a GPU row ran on, read from its hardware description; None: unknown
  (the step model then uses the chip's default, A3 High's, and approximations() says so)."""
  hw = row["hardware"]
  text = " ".join(str(hw.get(k) or "") for k in ("accelerator", "slice_name_as_published",
                                                   "naming_convention", "network")).lower()
  return next((net for word, net in _NETWORK_WORDS if word in text), None)


def topology(row: dict) -> tuple[str, int]:
  """(topology name of one slice, number of slices) to compile the row for."""
  hw = row["hardware"]
  if is_gpu(row):
    return "v5p:2x2x2", max(1, hw["total_chips"] // 8)
  accelerator = hw["accelerator"].split(" (")[0]
  if accelerator not in _GEN:
    raise ValueError(f"row {row['id']}: hardware.accelerator={hw['accelerator']!r} has no TPU topology here; "
                     f"known: {', '.join(_GEN)}")
  return slice_shape(_GEN[accelerator], hw["chips_per_slice"]), hw.get("num_slices", 1)


def slice_shape(gen: str, chips: int) -> str:
  """The Cloud TPU slice shape of `chips` chips of generation `gen`, as libtpu names it.

  2D tori (v2, v3, v5e, v6e): powers of two, the longer side at most twice the shorter
  (v6e-32 is 4x8, v6e-128 is 8x16). 3D tori (v4, v5p): under a 4x4x4 cube the small
  slices 2x2x1, 2x2x2, 2x2x4, 2x4x4; from 64 chips on, multiples of the cube, each dim
  a multiple of 4, grown on the shortest dim (v4-384 is 4x4x12, v5p-4096 is 8x16x16).
  """
  if gen in ("v2", "v3", "v5e", "v6e"):   # else 3D: v4, v5p, tpu7x
    if chips < 1 or chips & (chips - 1):
      raise ValueError(f"{gen} slices have a power-of-two chip count (1, 4, 8, 16, ... 256); got {chips}")
    short = 1 << (chips.bit_length() - 1) // 2
    return f"{gen}:{short}x{chips // short}"
  small = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4"}
  if chips in small:
    return f"{gen}:{small[chips]}"
  if chips < 64 or chips % 64:
    raise ValueError(f"{gen} slices hold 4, 8, 16, 32 chips or a multiple of 64 (4x4x4 cubes); got {chips}")
  dims = [4, 4, 4]
  for f in _factors(chips // 64):
    dims[dims.index(min(dims))] *= f
  return f"{gen}:{'x'.join(map(str, sorted(dims)))}"


def _factors(n: int) -> list[int]:
  out, p = [], 2
  while n > 1:
    while n % p == 0:
      out.append(p)
      n //= p
    p += 1
  return sorted(out, reverse=True)


def _custom(row: dict) -> tuple[str, bool]:
  """(shardax policy, exact) for MaxText's per-tensor policy ('custom'): the offload policy whose
  host set (layers/blocks.py OFFLOADED) is the one training.remat_offloaded names, exactly; else
  the nearest: offload_proj for the layer input with some projections, offload for the layer
  input with others, full when the layer input stays on device."""
  from shardax.layers.blocks import LAYER_INPUT, OFFLOADED, PROJECTIONS
  names = set(row["training"].get("remat_offloaded") or ())
  exact = next((policy for policy, offloaded in OFFLOADED.items() if names == set(offloaded)), None)
  if exact:
    return exact, True
  if LAYER_INPUT not in names:
    return "full", False
  return ("offload_proj" if names & set(PROJECTIONS) else "offload"), False


def remat(row: dict) -> str:
  """The shardax `model.remat` for the row's published remat policy (module docstring)."""
  policy = row["training"]["remat_policy"].split(" ")[0]
  if policy == "custom":
    return _custom(row)[0]
  if policy in _REMAT:
    return _REMAT[policy]
  return "offload" if "offload" in policy.lower() else "full"


_FLASH = ("flash", "splash")
_GPU_KERNELS = ("cudnn", "transformer engine", "transformerengine", "nvte")


def attention(row: dict) -> str:
  """The shardax `model.attention` for the row's published attention kernel.

  TPU rows: a Pallas flash / splash kernel -> 'flash' (when the sequence length suits the
  splash kernel: a multiple of 128; else 'xla'). GPU rows: a flash / cuDNN / fused kernel ->
  'flash' too: the TPU program that stands in for the GPU one then runs the splash kernel,
  which like cuDNN's never writes the S x S scores, and the kernel is priced at the GPU's
  measured flash rate (stepmodel.flash_kernel_seconds); 'fused' where the splash kernel
  cannot take the length (the stand-in compile then lowers it to XLA). Plain XLA attention
  ("no flash kernel" included), a missing field and anything unrecognized -> 'xla'
  (approximations() names the unrecognized). A GPU-only kernel on TPU
  hardware raises Unexpressible naming training.attention_kernel.
  """
  kernel = str(row["training"].get("attention_kernel") or "xla").lower()
  if "no flash" in kernel:
    return "xla"
  flash, gpu_kernel, gpu = any(w in kernel for w in _FLASH), any(w in kernel for w in _GPU_KERNELS), is_gpu(row)
  if gpu_kernel and not gpu:
    raise Unexpressible(f"row {row.get('id', '?')}: training.attention_kernel="
                        f"{row['training']['attention_kernel']!r} is a GPU kernel, but "
                        f"hardware.accelerator={row['hardware']['accelerator']!r} is a TPU")
  if not (flash or gpu_kernel or (gpu and "fused" in kernel)):
    return "xla"
  from shardax.layers import flash as splash
  seq = row["training"]["seq_len"]
  return "flash" if splash.supports(seq, seq) else "fused" if gpu else "xla"


class Unexpressible(ValueError):
  """A published row shardax cannot rebuild; the message names what is missing."""


def from_row(row: dict, num_layers: int | None = None):
  """The experiment config of a published run (optionally with fewer layers).

  Raises Unexpressible (never a KeyError) when the row needs something shardax's
  configs do not have, or lacks a field the rebuild needs.
  """
  try:
    return _from_row(row, num_layers)
  except KeyError as e:
    raise Unexpressible(f"row {row.get('id', '?')}: the published row has no field {e.args[0]!r}, "
                        f"which the rebuild needs") from None


def _from_row(row: dict, num_layers: int | None):
  m, t = row["model"], row["training"]
  act = m["activation"].lower()
  model = dict(
      num_layers=num_layers or m["num_layers"], d_model=m["d_model"], num_heads=m["num_heads"], d_ff=m["d_ff"],
      num_kv_heads=m.get("num_kv_heads"), head_dim=m.get("head_dim"), vocab_size=m["vocab_size"],
      tied_embedding=bool(m["tied_embeddings"]), mlp="gated" if m["gated_mlp"] else "plain",
      activation="silu" if "silu" in act else "gelu" if "gelu" in act else "relu",
      parallel_block="parallel" in m.get("block", ""), max_len=t["seq_len"], dtype="bfloat16",
      param_dtype="float32", remat=remat(row), scan_layers=True, attention=attention(row))
  name, slices = topology(row)
  if is_gpu(row):
    gpu_kind(row)   # a GPU the chip table lacks is named here, not in the step model
  axes, ici, dcn, preset = mesh_of(row, slices)
  if _is_moe(row):   # the dense layers' width is the row's dense_d_ff where it names one
    model.update(moe=_moe(row), d_ff=int(_first(m, "dense_d_ff", "d_ff")))
  return experiment_of(name=f"calibration.{row['id']}", model=TransformerConfig(**model),
                       data=DataConfig(source="synthetic", seq_len=t["seq_len"]),
                       train=TrainConfig(global_batch=t["global_batch_seqs"]),
                       mesh=MeshConfig(topology=name, axes=axes, ici=ici, dcn=dcn if slices > 1 else (),
                                       network=gpu_network(row) if is_gpu(row) else None),
                       sharding=ShardingConfig(preset=preset, rules=expert_rules() if "expert" in axes else None))


# Mesh axes of the published layouts -> shardax's (data: batch only; fsdp: batch and weights'
# embed dim; model: Megatron; expert: experts). Pax's replica x data x mdl is MaxText's
# data x fsdp x tensor under other names.
_MAXTEXT_AXES = {"data": "data", "fsdp": "fsdp", "tensor": "model", "expert": "expert"}
_PAX_AXES = {"replica": "data", "data": "fsdp", "mdl": "model"}
_NOTE_KEYS = {"mesh_shape", "s0", "s1", "mesh_axis_names", "note"}


def mesh_of(row: dict, slices: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...], str]:
  """(mesh axes, ici, dcn, sharding preset) of a row's published layout."""
  sh = row["sharding"]
  ici, dcn = sh["ici"], sh.get("dcn") or {}
  if "mesh_shape" in ici and len(ici["mesh_shape"]) == 2:   # Lingvo: 2D [s0, s1] over all cores
    return ("data", "model"), tuple(ici["mesh_shape"]), (1, 1), "2d"
  if "mesh_shape" in ici:                                    # a shape with its axis names
    names = ici.get("mesh_axis_names") or sh.get("mesh_axis_names")
    if not names or len(names) != len(ici["mesh_shape"]):
      raise Unexpressible(f"row {row['id']}: sharding.ici.mesh_shape={ici['mesh_shape']} needs "
                          f"sharding.ici.mesh_axis_names, one name per dim")
    ici = dict(zip(names, ici["mesh_shape"]))
    if isinstance(dcn, dict) and "mesh_shape" in dcn:
      dcn = dict(zip(names, dcn["mesh_shape"]))
  table = _PAX_AXES if {"replica", "mdl"} & set(ici) else _MAXTEXT_AXES
  unknown = sorted(k for k in set(ici) | set(dcn) - _NOTE_KEYS
                   if k not in table and max(ici.get(k, 1) or 1, dcn.get(k, 1) or 1) > 1)
  if unknown:
    raise Unexpressible(f"row {row['id']}: mesh axes {unknown} have no shardax counterpart "
                        f"(known: {', '.join(table)}); shardax has no rules for them")
  axes = ("data", "fsdp", "model") + (("expert",) if "expert" in ici or "expert" in dcn else ())
  back = {v: k for k, v in table.items()}
  ici_shape = tuple(int(ici.get(back[a], 1) or 1) for a in axes)
  dcn_shape = tuple(int(dcn.get(back[a], 1) or 1) for a in axes)
  if slices > 1 and math.prod(dcn_shape) == 1:   # slices (GPU rows: VMs) over data when the row says nothing
    dcn_shape = (slices,) + dcn_shape[1:]
  return axes, ici_shape, dcn_shape, "dp_fsdp_tp"


def expert_rules() -> tuple:
  """dp_fsdp_tp with the experts on their own `expert` axis (as the `expert_axis` preset): the
  batch splits over data, fsdp and expert; a tensor whose `expert` dim took that axis keeps
  its batch on data and fsdp (the second batch rule)."""
  from shardax.sharding import rules
  dense = rules.PRESETS["dp_fsdp_tp"]
  return ((("batch", ("data", "fsdp", "expert")), ("batch", ("data", "fsdp")), ("expert", "expert"))
          + tuple(r for r in dense if r[0] != "batch"))


def _is_moe(row: dict) -> bool:
  m = row["model"]
  return "moe" in str(m.get("arch_type", "")).lower() or bool(m.get("num_experts"))


def _first(d: dict, *keys):
  return next((d[k] for k in keys if d.get(k) is not None), None)


_DROPLESS = ("dropless", "megablox", "ragged", "grouped", "sparse_matmul")


def moe_dispatch(row: dict) -> str:
  """'capacity' or 'dropless' for the row's MoE implementation (training.moe_impl or
  moe_kernel) and capacity factor. Dropless / megablox / ragged / grouped / sparse_matmul
  names, or a capacity factor <= 0 (MaxText's -1), are dropless; 'capacity' or a positive
  capacity factor is capacity; a row naming neither is capacity at top-2 (GShard, as before)
  and dropless otherwise (the only dispatch shardax has for top-k != 2; approximations()
  says so). Any other implementation name raises Unexpressible naming the field."""
  t = row["training"]
  impl = str(_first(t, "moe_impl", "moe_kernel") or "").lower()
  capacity = _first(t, "capacity_factor", "moe_capacity_factor")
  if any(w in impl for w in _DROPLESS) or (capacity is not None and float(capacity) <= 0):
    return "dropless"
  if "capacity" in impl or capacity is not None:
    return "capacity"
  if impl:
    raise Unexpressible(f"row {row['id']}: training.moe_impl={impl!r} is neither a capacity nor a dropless "
                        f"implementation (known: capacity, {', '.join(_DROPLESS)}); shardax's "
                        f"model.moe.dispatch is 'capacity' or 'dropless'")
  return "capacity" if _top_k(row) == 2 else "dropless"


def _top_k(row: dict) -> int:
  return int(_first(row["model"], "experts_per_token", "num_experts_per_tok", "top_k", "moe_top_k") or 2)


def _moe(row: dict) -> MoEConfig:
  """A row's mixture of experts as shardax's MoE config; what it lacks is named, never guessed."""
  m, t = row["model"], row["training"]
  experts = _first(m, "num_experts", "num_local_experts")
  if experts is None:
    raise Unexpressible(f"row {row['id']}: an MoE row without model.num_experts")
  top_k = _top_k(row)
  if not 1 <= top_k <= int(experts):
    raise Unexpressible(f"row {row['id']}: model.experts_per_token={top_k} is not in [1, num_experts="
                        f"{int(experts)}]")
  score = str(_first(m, "router_score", "scoring_func", "score") or "softmax").lower()
  if score not in ("softmax", "sigmoid"):
    raise Unexpressible(f"row {row['id']}: model.router_score={score!r}; shardax's routers score with "
                        f"'softmax' or 'sigmoid'")
  dispatch, capacity = moe_dispatch(row), {}
  if dispatch == "capacity":
    if top_k != 2 or score != "softmax":
      raise Unexpressible(f"row {row['id']}: capacity dispatch (training.moe_impl / capacity_factor) with "
                          f"model.experts_per_token={top_k}, router score {score!r}: shardax's capacity "
                          f"dispatch is GShard's top-2 softmax gating only (dropless takes any top-k)")
    factor = _first(t, "capacity_factor", "moe_capacity_factor")
    # published top-k routers keep every chosen expert
    capacity = dict(second_expert="all", **({} if factor is None else {"capacity_factor": float(factor)}))
  return MoEConfig(
      num_experts=int(experts), d_ff=int(_first(m, "expert_d_ff", "moe_d_ff", "d_ff")),
      every=int(_first(m, "moe_every", "moe_layer_interval") or 1),
      num_shared_experts=int(_first(m, "num_shared_experts", "n_shared_experts", "shared_experts") or 0),
      first_dense_layers=int(_first(m, "first_dense_layers", "first_k_dense_replace") or 0),
      top_k=top_k, score=score, dispatch=dispatch, **capacity)


def approximations(row: dict) -> list[str]:
  """What the shardax rebuild does differently from the published run."""
  m, t = row["model"], row["training"]
  out = []
  if "relative" in m["position_encoding"].lower():
    out.append("RoPE for relative bias")
  out += _attention_notes(row)
  policy = t["remat_policy"].split(" ")[0]
  if remat(row) != policy and not (policy == "custom" and _custom(row)[1]):
    out.append(f"remat {remat(row)} for {t['remat_policy'].split(' (')[0]}")
  if "adafactor" in t["optimizer"].lower():
    out.append("AdamW for Adafactor")
  if is_gpu(row):
    out.append(f"TPU program, {gpu_kind(row).removeprefix('NVIDIA ').split(' ')[0]} timing")
    if gpu_network(row) is None:
      out.append("network not named: A3 High's")
  if _is_moe(row) and not _first(t, "moe_impl", "moe_kernel", "capacity_factor", "moe_capacity_factor") \
      and _top_k(row) != 2:
    out.append("dropless dispatch (the row names no MoE implementation)")
  if not t.get("scan_layers", True):
    out.append("scanned for unrolled")
  return out


def _attention_notes(row: dict) -> list[str]:
  """What the attention mapping approximates: a kernel read as plain XLA attention (which
  computes every score, the masked half included) where the row names a kernel."""
  kernel = str(row["training"].get("attention_kernel") or "").lower()
  if not kernel or "no flash" in kernel:
    return []
  chosen, flash = attention(row), any(w in kernel for w in _FLASH)
  if chosen == "fused":   # the TPU stand-in compile lowers jax.nn.dot_product_attention to XLA
    return ["XLA attention for cuDNN flash (fused, TPU compile)"]
  if chosen == "flash" and is_gpu(row):
    return ["TPU splash kernel for cuDNN flash (stand-in compile; priced at the GPU's flash rate)"]
  if chosen == "xla" and flash:
    return ["XLA attention for flash (seq_len not a multiple of 128)"]
  if chosen == "xla" and not any(w in kernel for w in ("xla", "dot-product", "dot_product", "einsum")):
    return [f"XLA attention for {row['training']['attention_kernel'].split(' (')[0]}"]
  return []


def published_step_seconds(row: dict) -> float:
  """The row's step time: published, or derived from its figures under its own FLOP convention
  (for MaxText v5p, the non-causal attention count its notes call most likely)."""
  if row["published"].get("step_time_s"):
    return float(row["published"]["step_time_s"])
  d = row["derived"]
  return float(d.get("step_time_s") or d["step_time_s_if_noncausal"])
