"""Decoding with a KV cache: batches of prompts, sharded like training, one compiled step.

    prompts --tokenizer()--> ids, right-padded to [b, P] (b rounded up to the data-parallel
      degree with empty rows, P to a multiple of 8, so few shapes compile)
    prefill:  one pass over [b, P] (positions 0.. on each row's prompt, -1 on its padding)
              fills the cache [.., b, S = P + max_new, kv_heads, d] (a ring of window or
              chunk slots instead of S on windowed and chunked layers: layers/attention.py)
              and returns the logits of each row's last prompt token
    generate: a `lax.while_loop` inside one jit, one token per row per step: sample
              (greedy / temperature / top-k / top-p, a key per row and step), stop rows that
              emit a stop token, write each row's next cache slot at its own position;
              it ends at max_new_tokens or when every row has stopped

The cache (trainer/decode_cache.py: its shapes, ring slots, shardings and prefill
positions) is a plain pytree whose leaves carry logical axes, so the experiment's rules
shard it like the params and it is the jitted functions' output with that sharding.
Without a cache (`Generator(..., use_cache=False)`: the benchmark's baseline and a check)
each step reruns the model over the whole [b, P + max_new] window instead: same tokens,
quadratic work.

Sampling keys: row r, step t uses fold_in(fold_in(key(seed), r), t), so a row's
text depends on its prompt, its row and the seed, not on the batch size or mesh.

MoE models decode on `TransformerConfig.for_decode()`: every dispatch at its no-overflow
bound, whatever the training config bets on balance, so no token copy is dropped and an
expert-parallel decode is one device's. Each prefill and generate step also returns the
copies each MoE layer routed to an expert that gave them no output (0 at the bound); any
other count stops the decode with `DroppedCopiesError` naming the layer and the phase,
never tokens argmaxed from poisoned (NaN) or truncated logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from shardax import models
from shardax.layers.transformer import moe_layer
from shardax.sharding import rules as rules_lib
from shardax.trainer.data import preparation, tokenizers
from shardax.trainer.decode_cache import CacheLayout, decode_config, prefill_positions

PAD_ID = 0


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How to pick each new token. temperature 0 = greedy (top_k/top_p then unused);
  top_k 0 = off; top_p 1.0 = off; stop_tokens end a row (the stop token is not part
  of the completion's text)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 64
  stop_tokens: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = no top-k filter)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = no nucleus filter)")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@dataclasses.dataclass(frozen=True)
class Completion:
  prompt: str
  text: str
  ids: list[int]          # the new ids, stop token excluded
  finish_reason: str      # "stop" (a stop token) or "length" (max_new_tokens)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class Result:
  """New ids [rows, max_new] (PAD after a row stopped), how many each row made
  (counting its stop token), whether it stopped, and the wall times of the two phases."""
  ids: np.ndarray
  counts: np.ndarray
  stopped: np.ndarray
  prefill_s: float
  generate_s: float
  steps: int


def tokenizer(exp=None) -> tokenizers.Tokenizer:
  """The one place decoding turns text into ids and back: the experiment's data tokenizer
  (trainer/data/tokenizers.py), byte-level when no experiment is given."""
  return preparation.load_tokenizer(exp.data) if exp is not None else tokenizers.ByteTokenizer()


def filter_logits(logits: jax.Array, s: Sampling) -> jax.Array:
  """float32 [b, V] / temperature, with tokens outside top-k / top-p set to -inf."""
  logits = logits.astype(jnp.float32) / s.temperature
  if s.top_k:
    kth = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if s.top_p < 1.0:  # smallest set of most likely tokens whose probability reaches top_p
    desc = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs        # mass of the more likely tokens
    keep = jnp.sum(before < s.top_p, axis=-1, keepdims=True)   # >= 1
    cutoff = jnp.take_along_axis(desc, keep - 1, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return logits


def next_tokens(logits: jax.Array, key: jax.Array, step: jax.Array, s: Sampling) -> jax.Array:
  """int32 [b]: each row's next token (keys per row and step, see the module docstring)."""
  if s.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  rows = jnp.arange(logits.shape[0])
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(key, r), step))(rows)
  filtered = filter_logits(logits, s)
  return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


class DroppedCopiesError(ValueError):
  """A decode call's MoE dispatch gave some token copies no expert output."""


def check_dropped(model_cfg, dropped, phase: str) -> None:
  """Raises `DroppedCopiesError` naming the model layer (`moe_layer`) of each MoE layer whose
  count in `dropped` [MoE layers] (a cached call's, `TransformerLM.cached`) is not 0, and the
  decode `phase`."""
  dropped = np.asarray(dropped)
  bad = np.flatnonzero(dropped > 0)
  if not bad.size:
    return
  moe = model_cfg.moe
  layers = ", ".join(f"layer {moe_layer(model_cfg, int(u))} ({int(round(dropped[u]))} copies)"
                     for u in bad)
  fields = (f"expert_buffer={moe.expert_buffer}, expert_overflow={moe.expert_overflow!r}"
            if moe.dispatch == "dropless" else
            f"capacity_factor={moe.capacity_factor}, group_size={moe.group_size}")
  raise DroppedCopiesError(
      f"decode ({phase}): MoE {layers} routed token copies to experts that gave them no output, "
      f"so its logits are not the model's; the config decoding ran is below the no-overflow bound "
      f"(model.moe.dispatch={moe.dispatch!r}, {fields}, dispatch_chunks={moe.dispatch_chunks}): "
      f"decode with the config TransformerConfig.for_decode() gives (decode_config), which "
      f"Generator builds unless that is overridden")


class Generator:
  """Samples continuations of batches of prompts from a model's params.

  Build it with `Generator.from_job_dir(exp, job_dir)` (latest checkpoint, on the
  experiment's mesh and rules) or `Generator(model_cfg, params, mesh, rules)`; then
  `complete(["def f(", ...], Sampling(...))` -> list of `Completion`.
  """

  def __init__(self, model_cfg, params, mesh=None, rules: rules_lib.Rules | None = None,
               allow_uneven: bool = False, use_cache: bool = True, tok: tokenizers.Tokenizer | None = None,
               bounded_cache: bool = True):
    """`bounded_cache=False`: every layer caches all positions, windowed and chunked ones too
    (no ring; the reference a ring decode is checked against)."""
    self.model_cfg = decode_config(model_cfg)
    self.bounded_cache = bounded_cache
    self.params, self.mesh, self.rules = params, mesh, rules
    self.allow_uneven, self.use_cache = allow_uneven, use_cache
    self.tokenizer = tok or tokenizer()
    abstract = nnx.eval_shape(lambda: models.build(self.model_cfg, nnx.Rngs(0)))
    self.graphdef = nnx.split(abstract, nnx.Param, ...)[0]
    self._abstract_model = abstract
    self.cache = CacheLayout(abstract, mesh, rules, allow_uneven, bounded_cache)
    self._compiled: dict = {}

  @classmethod
  def from_job_dir(cls, exp, job_dir: str, **kw) -> "Generator":
    from shardax.sharding import make_mesh
    from shardax.trainer import checkpoint, model_setup
    setup = model_setup.create(exp, make_mesh(exp.mesh))
    params, _ = checkpoint.restore_params(setup, str(job_dir))
    kw.setdefault("tok", tokenizer(exp))
    return cls(exp.model, params, setup.mesh, setup.rules, exp.sharding.allow_uneven, **kw)

  # --- shapes and shardings: trainer/decode_cache.py ---------------------------------------

  def cache_spec(self, batch: int, length: int):
    """Tree of `CacheSpec` for `batch` rows and `length` slots."""
    return self.cache.spec(batch, length)

  def cache_shardings(self, batch: int, length: int):
    """NamedSharding of each cache array, from the rules (None without a mesh)."""
    return self.cache.shardings(batch, length)

  def _context(self) -> contextlib.ExitStack:
    """The mesh and rules in force while tracing and running (nothing without a mesh)."""
    stack = contextlib.ExitStack()
    if self.mesh is not None:
      stack.enter_context(jax.set_mesh(self.mesh))
      stack.enter_context(rules_lib.use_rules(self.rules, self.allow_uneven))
    return stack

  # --- the compiled phases --------------------------------------------------------------

  def _prefill_fn(self, batch: int, length: int):
    def prefill(params, tokens, lengths):
      cache = self.cache.zeros(batch, length)
      model = nnx.merge(self.graphdef, params)
      positions = prefill_positions(tokens.shape, lengths)
      logits, cache, dropped = model.cached(tokens, positions, cache)
      last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
      return cache, last, dropped

    return jax.jit(prefill, out_shardings=(self.cache_shardings(batch, length), None, None))

  def _generate_fn(self, batch: int, length: int, s: Sampling):
    """(params, cache, logits, lengths, key) -> (ids, counts, stopped, steps, dropped, at):
    `dropped` [units] the copies each MoE layer left without expert output, summed over the
    steps, `at` the first step with any (-1: none); the loop ends at that step."""
    n = s.max_new_tokens
    stop = jnp.asarray(s.stop_tokens or (-1,), jnp.int32)

    def loop(params, cache, logits, lengths, key):
      model = nnx.merge(self.graphdef, params)

      def body(carry):
        t, cache, logits, ids, counts, stopped, dropped, at = carry
        tok = jnp.where(stopped, PAD_ID, next_tokens(logits, key, t, s))
        ids = ids.at[:, t].set(tok)
        counts = counts + (~stopped).astype(jnp.int32)
        stopped = stopped | jnp.isin(tok, stop)
        logits, cache, lost = model.cached(tok[:, None], (lengths + t)[:, None], cache)
        at = jnp.where((at < 0) & jnp.any(lost > 0), t, at)
        return t + 1, cache, logits[:, 0], ids, counts, stopped, dropped + lost, at

      def more(carry):
        return (carry[0] < n) & ~jnp.all(carry[5]) & (carry[7] < 0)

      units = self._abstract_model.cfg.num_units
      init = (jnp.int32(0), cache, logits, jnp.full((batch, n), PAD_ID, jnp.int32),
              jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
              jnp.zeros((units,), jnp.float32), jnp.int32(-1))
      t, _, _, ids, counts, stopped, dropped, at = jax.lax.while_loop(more, body, init)
      return ids, counts, stopped, t, dropped, at

    return jax.jit(loop)

  def _uncached_fn(self, batch: int, length: int, s: Sampling):
    """The baseline: every step reruns the model over the whole [batch, length] window."""
    n = s.max_new_tokens
    stop = jnp.asarray(s.stop_tokens or (-1,), jnp.int32)

    def loop(params, tokens, lengths, key):
      model = nnx.merge(self.graphdef, params)
      rows = jnp.arange(batch)

      def body(carry):
        t, tokens, ids, counts, stopped = carry
        logits = model(tokens)[rows, lengths + t - 1]
        tok = jnp.where(stopped, PAD_ID, next_tokens(logits, key, t, s))
        tokens = tokens.at[rows, lengths + t].set(tok)
        ids = ids.at[:, t].set(tok)
        counts = counts + (~stopped).astype(jnp.int32)
        return t + 1, tokens, ids, counts, stopped | jnp.isin(tok, stop)

      def more(carry):
        return (carry[0] < n) & ~jnp.all(carry[4])

      init = (jnp.int32(0), tokens, jnp.full((batch, n), PAD_ID, jnp.int32),
              jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool))
      t, _, ids, counts, stopped = jax.lax.while_loop(more, body, init)
      return ids, counts, stopped, t

    return jax.jit(loop)

  def _fn(self, kind: str, batch: int, length: int, s: Sampling | None = None):
    s = s and dataclasses.replace(s, seed=0)   # the seed is an argument, not compiled in
    key = (kind, batch, length, s)
    if key not in self._compiled:
      make = {"prefill": self._prefill_fn, "generate": self._generate_fn,
              "uncached": self._uncached_fn}[kind]
      self._compiled[key] = make(batch, length) if s is None else make(batch, length, s)
    return self._compiled[key]

  # --- running --------------------------------------------------------------------------

  def padded(self, prompts: Sequence[Sequence[int]], max_new: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, width], lengths [rows]): right-padded, rows a multiple of the
    data-parallel degree (extra rows hold one PAD), width = P rounded up to 8 + max_new."""
    if not prompts:
      raise ValueError("no prompts to decode: give at least one (--prompt or --prompts_file)")
    ids = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
    ids = [p if p.size else np.asarray([PAD_ID], np.int32) for p in ids]  # '' continues a document start
    mult = self.cache.row_multiple()
    rows = -(-len(ids) // mult) * mult
    prompt_len = -(-max(p.size for p in ids) // 8) * 8
    width = prompt_len + max_new
    max_len = getattr(self.model_cfg, "max_len", None)
    longest = max(p.size for p in ids)
    if max_len is not None and longest + max_new > max_len:   # positions past it: garbage
      raise ValueError(f"decode: the longest prompt ({longest} tokens) + max_new_tokens ({max_new}) = "
                       f"{longest + max_new} exceeds model.max_len={max_len}; shorten the prompt, lower "
                       f"--max_new_tokens, or raise --set model.max_len (up to the length the model "
                       f"was trained for)")
    tokens = np.full((rows, width), PAD_ID, np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(ids):
      tokens[i, :p.size] = p
      lengths[i] = p.size
    return tokens, lengths

  def _put(self, x: np.ndarray, logical) -> jax.Array:
    if self.mesh is None or self.rules is None:
      return jnp.asarray(x)
    return jax.device_put(x, NamedSharding(self.mesh, self.cache.partition(logical, x.shape, "prompt batch")))

  def prefill(self, tokens: np.ndarray, lengths: np.ndarray, max_new: int):
    """(cache, logits of each row's last prompt token) for padded `tokens` [rows, width]
    (width = prompt part + max_new, as `padded` makes them); the cache is sharded as the
    rules say (`cache_shardings`). `DroppedCopiesError` if an MoE layer dropped copies."""
    rows, width = tokens.shape
    with self._context():
      cache, logits, dropped = self._fn("prefill", rows, width)(
          self.params, self._put(tokens[:, :width - max_new], ("batch", "length")),
          self._put(lengths, ("batch",)))
    check_dropped(self.model_cfg, jax.device_get(dropped), "prefill")
    return cache, logits

  def generate(self, cache, logits, lengths: np.ndarray, s: Sampling, width: int):
    """(ids [rows, max_new], counts, stopped, steps): the generate loop from a prefill's
    cache and last logits, for rows of `width` slots (`padded`). `DroppedCopiesError` if
    an MoE layer dropped copies in a step (the loop stops at that step)."""
    rows = lengths.shape[0]
    with self._context():
      out = self._fn("generate", rows, width, s)(self.params, cache, logits,
                                                  self._put(lengths, ("batch",)), jax.random.key(s.seed))
      ids, counts, stopped, steps, dropped, at = jax.device_get(out)
    check_dropped(self.model_cfg, dropped, f"generate step {int(at)}")
    return ids, counts, stopped, steps

  def run(self, prompts: Sequence[Sequence[int]], s: Sampling) -> Result:
    """Decode a batch of id sequences; rows beyond len(prompts) are padding."""
    tokens, lengths = self.padded(prompts, s.max_new_tokens)
    rows, width = tokens.shape
    key = jax.random.key(s.seed)
    start = time.perf_counter()
    if self.use_cache:
      cache, logits = self.prefill(tokens, lengths, s.max_new_tokens)
      jax.block_until_ready(logits)
    prefill_s = time.perf_counter() - start if self.use_cache else 0.0
    start = time.perf_counter()
    if self.use_cache:
      ids, counts, stopped, steps = self.generate(cache, logits, lengths, s, width)
    else:
      with self._context():
        out = self._fn("uncached", rows, width, s)(self.params, self._put(tokens, ("batch", "length")),
                                                    self._put(lengths, ("batch",)), key)
        ids, counts, stopped, steps = jax.device_get(out)
    generate_s = time.perf_counter() - start
    n = len(prompts)
    return Result(ids[:n], counts[:n], stopped[:n], prefill_s, generate_s, int(steps))

  def complete(self, prompts: Sequence[str], s: Sampling) -> list[Completion]:
    """Text in, `Completion`s out (one per prompt, in order). Each prompt starts with the
    tokenizer's end-of-document id, as every document does in the packed training windows."""
    tok = self.tokenizer
    start = [] if tok.own_start else [tok.eos_id]   # a model tokenizer adds its own BOS
    result = self.run([[*start, *tok.encode(p)] for p in prompts], s)
    out = []
    for prompt, ids, count, stopped in zip(prompts, result.ids, result.counts, result.stopped):
      new = [int(i) for i in ids[:count - 1 if stopped else count]]
      out.append(Completion(prompt, self.tokenizer.decode(np.asarray(new, np.int32)), new,
                            "stop" if stopped else "length"))
    return out


def read_prompts(path: str) -> list[str]:
  """Prompts from a file: JSONL ({"prompt": ...} or a JSON string per line) or plain text
  lines (one prompt per line, '\\n' escapes kept as text). Blank lines are skipped."""
  from etils import epath
  lines = [l for l in epath.Path(path).read_text().splitlines() if l.strip()]
  if path.endswith(".jsonl") or (lines and lines[0].lstrip().startswith(("{", '"'))):
    prompts = []
    for i, line in enumerate(lines, 1):
      try:
        item = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i}: not JSON ({e}); use one JSON object or string per line, "
                         f"or a .txt file with one prompt per line") from None
      if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        prompts.append(item["prompt"])
      elif isinstance(item, str):
        prompts.append(item)
      else:
        raise ValueError(f"{path}:{i}: expected {{\"prompt\": \"...\"}} or a JSON string, got {line[:60]!r}")
    return prompts
  return lines


def write_completions(job_dir: str, completions: Sequence[Completion]) -> str:
  """Writes job_dir/completions.jsonl (one JSON object per prompt); returns its path."""
  from etils import epath
  path = epath.Path(job_dir) / "completions.jsonl"
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(c.to_json() + "\n" for c in completions))
  return str(path)


def from_job_dir(exp, job_dir: str, prompts: Sequence[str], s: Sampling) -> list[Completion]:
  """The CLI's decode: completions of `prompts` from the latest checkpoint in `job_dir`,
  also written to job_dir/completions.jsonl."""
  generator = Generator.from_job_dir(exp, job_dir)
  completions = generator.complete(prompts, s)
  from shardax.trainer import distributed
  if distributed.is_primary():
    write_completions(job_dir, completions)
  return completions


def print_completions(completions: Sequence[Completion], file=sys.stdout) -> None:
  for c in completions:
    print(c.to_json(), file=file, flush=True)
