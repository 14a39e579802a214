"""The data section of an experiment: where batches come from, checked on build.

`DataConfig` names a text source (or a weighted mixture of them) with its tokenizer, or an
image source; `IMAGE_SOURCES` says what each image source gives (sizes, classes, channels) so
model configs (configs/vision.py) can be checked against it without reading data. Reading,
preparing and packing the data is trainer/data/'s job; this module only describes and
validates.
"""

from __future__ import annotations

import dataclasses

from shardax.configs.errors import ConfigError
from shardax.configs.errors import require as _require
from shardax.configs.tokenizer_spec import TokenizerError, check_spec, trained_vocab


@dataclasses.dataclass(frozen=True)
class ImageSource:
  """What an image source (trainer/data/images.py) gives: the configs check models against it."""
  default_size: tuple[int, ...]   # spatial sizes when data.image_size is () (its rank: 2D or 3D)
  multiple: int                   # every size must be a multiple of this
  num_classes: int
  in_channels: int


IMAGE_SOURCES = {"shapes3d": ImageSource((16, 16, 16), 1, num_classes=3, in_channels=1),
                 "digits": ImageSource((16, 16), 8, num_classes=10, in_channels=1)}


def spatial_shape(data: DataConfig) -> tuple[int, ...]:
  """(D, H, W) or (H, W) of an image source's examples."""
  if data.source not in IMAGE_SOURCES:
    raise ValueError(f"data.source={data.source!r} is not an image source; use one of {tuple(IMAGE_SOURCES)}")
  return tuple(data.image_size) or IMAGE_SOURCES[data.source].default_size


MIXTURE = "mixture"   # data.source of a config with data.mixture (its sources are there)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where batches come from.

  source: "stdlib"    the Python standard library's sources;
          "tfds:NAME" any tfds dataset already prepared under `data_dir`, field `text_key`;
          "files:GLOB" local text / JSONL (field `text_key`) / Parquet files;
          "synthetic" random tokens (for benchmarks and dry runs);
          "shapes3d"  generated volumes of spheres and cubes with per-voxel labels;
          "digits"    scikit-learn's bundled 8x8 handwritten digits, upsampled
                      (image sources: trainer/images.py).
  image_size: spatial shape of image sources, (D, H, W) or (H, W); () = the source's default.
  Text sources are tokenized once by `tokenizer` ("byte", "spm:PATH", "spm:train:VOCAB",
  "hf:PATH" / a tokenizer .json) into `num_shards` ArrayRecord files per split under
  `data_dir/prepared/` (`data_dir` may be gs://), then packed into seq_len windows
  (trainer/data/).
  mixture: text sources drawn by weight, ((SOURCE, WEIGHT), ...), e.g.
          --set data.mixture='(("files:gs://b/web/*.jsonl", 0.7), ("stdlib", 0.3))'.
          A separate field (not a syntax inside `source`, whose globs and tfds names
          hold ':' and ',') so each entry is a source exactly as `source` takes it. Set,
          it replaces `source` (which then reads "mixture"); each source is prepared on
          its own with the one shared `tokenizer`, documents are mixed by grain
          (MapDataset.mix) and eval reports every source and the token-weighted total.
  """
  source: str = "stdlib"
  data_dir: str = "~/.cache/shardax/datasets"
  text_key: str = "text"
  seq_len: int = 256
  validation_fraction: float = 0.05
  seed: int = 0
  worker_count: int = 0
  image_size: tuple[int, ...] = ()
  tokenizer: str = "byte"
  num_shards: int = 8                 # ArrayRecord files per split; hosts read disjoint ones
  mixture: tuple[tuple[str, float], ...] = ()   # ((source, weight), ...); () = `source` alone

  def __post_init__(self):
    if self.mixture or self.source == MIXTURE:
      self._check_mixture()
      object.__setattr__(self, "source", MIXTURE)   # frozen: the one place source is derived
      object.__setattr__(self, "mixture", tuple((s, float(w)) for s, w in self.mixture))
    _require(self.source in ("stdlib", "synthetic", MIXTURE) + tuple(IMAGE_SOURCES)
             or self.source.startswith(("tfds:", "files:")),
             f"data.source={self.source!r}: use 'stdlib', 'synthetic', 'tfds:NAME', 'files:GLOB' "
             f"or an image source {tuple(IMAGE_SOURCES)}")
    try:
      check_spec(self.tokenizer)
    except TokenizerError as e:
      raise ConfigError(str(e)) from None
    _require(self.num_shards >= 1, f"data.num_shards={self.num_shards} must be >= 1")
    if self.source in IMAGE_SOURCES:
      src = IMAGE_SOURCES[self.source]
      rank, multiple = len(src.default_size), src.multiple
      size = tuple(self.image_size)
      _require(size == () or (len(size) == rank and all(s >= 2 and s % multiple == 0 for s in size)),
               f"data.image_size={size!r}: data.source={self.source!r} needs {rank} sizes, each a "
               f"multiple of {multiple} and >= 2 (or () for the default)")
    _require(self.seq_len >= 2, f"data.seq_len={self.seq_len} must be >= 2")
    _require(0.0 < self.validation_fraction < 1.0,
             f"data.validation_fraction={self.validation_fraction} must be in (0, 1)")

  def _check_mixture(self) -> None:
    """A mixture is >= 2 distinct text sources with positive weights and one tokenizer."""
    example = "--set data.mixture='((\"files:/data/*.jsonl\", 0.7), (\"stdlib\", 0.3))'"
    _require(bool(self.mixture), f"data.source='mixture' needs data.mixture; e.g. {example}")
    _require(self.source in ("stdlib", MIXTURE),
             f"data.source={self.source!r} and data.mixture are both set; a mixture names its "
             f"sources itself: drop data.source or data.mixture")
    _require(isinstance(self.mixture, (tuple, list)) and len(self.mixture) >= 2,
             f"data.mixture={self.mixture!r}: give two or more (source, weight) pairs, e.g. "
             f"{example} (one source alone is data.source)")
    for entry in self.mixture:
      ok = isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str) \
          and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool)
      _require(ok, f"data.mixture entry {entry!r} is not a (source, weight) pair; e.g. {example}")
      src, w = entry
      _require(src == "stdlib" or src.startswith(("tfds:", "files:")),
               f"data.mixture source {src!r}: a mixture draws text sources only ('stdlib', "
               f"'tfds:NAME', 'files:GLOB')")
      _require(w > 0 and w == w and w != float("inf"),
               f"data.mixture weight {w!r} of {src!r} must be a positive finite number")
    names = [s for s, _ in self.mixture]
    _require(len(set(names)) == len(names),
             f"data.mixture names a source twice ({names}); give each once with its total weight")
    _require(trained_vocab(self.tokenizer) is None,
             f"data.tokenizer={self.tokenizer!r} trains one vocabulary per prepared source, but a "
             f"mixture needs one shared tokenizer: prepare one source with it first, then give "
             f"its file (data.tokenizer='spm:<data_dir>/prepared/<dir>/tokenizer.model')")

  @property
  def components(self) -> tuple[tuple[str, float], ...]:
    """(source, weight) of each source read: the mixture's (weights summing to 1), or
    the one source with weight 1."""
    if not self.mixture:
      return ((self.source, 1.0),)
    total = sum(w for _, w in self.mixture)
    return tuple((s, w / total) for s, w in self.mixture)

  def for_source(self, source: str) -> DataConfig:
    """This config reading `source` alone: a mixture component's preparation and eval."""
    return dataclasses.replace(self, source=source, mixture=())
