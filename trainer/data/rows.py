"""Which rows of every global batch this process loads (text, synthetic and image data).

Below both `inputs` (the loader) and `images` (image sources), so neither imports the
other: each process reads only the rows its devices hold.
"""

from __future__ import annotations

import grain
import jax


def process_rows(global_batch: int, seq_len: int,
                 sharding: jax.sharding.Sharding | None = None,
                 process_index: int | None = None,
                 process_count: int | None = None) -> tuple[int, int]:
  """[start, stop): the rows of every global batch that this process loads.

  Without a sharding: [p*B/P, (p+1)*B/P). With one, the rows its addressable devices hold
  (the same thing on a mesh whose batch axis runs across processes in order; all of
  [0, B) where the batch is replicated across processes), so the local data always fits
  `jax.make_array_from_process_local_data`.
  """
  count = jax.process_count() if process_count is None else process_count
  index = jax.process_index() if process_index is None else process_index
  if global_batch < 1 or global_batch % count:
    raise ValueError(
        f"global batch {global_batch} is not divisible by the process count {count} "
        f"(jax.process_count()); each process loads global_batch/process_count rows, so pick "
        f"train.global_batch as a multiple of {count}")
  if sharding is None or process_index is not None:
    local = global_batch // count
    return index * local, (index + 1) * local
  try:
    slices = sharding.addressable_devices_indices_map((global_batch, seq_len)).values()
  except ValueError as e:
    raise ValueError(f"global batch {global_batch} does not split evenly over {sharding}: "
                     f"{e}") from e
  rows = sorted({r for sl in slices for r in range(*sl[0].indices(global_batch))})
  if rows != list(range(rows[0], rows[-1] + 1)):
    raise ValueError(f"this process's devices hold non-contiguous rows of the batch under "
                     f"{sharding}; order the mesh so the batch axis runs across processes")
  return rows[0], rows[-1] + 1


class ProcessRows(grain.MapDataset):
  """Element i = row start + (i mod n) of global batch (i div n), n = stop - start.

  So the processes together read each global batch once, in row order, and no process
  reads windows it does not keep.
  """

  def __init__(self, parent: grain.MapDataset, global_batch: int, start: int, stop: int):
    super().__init__(parent)
    self._global, self._start, self._local = global_batch, start, stop - start

  def __len__(self) -> int:
    return (len(self._parent) // self._global) * self._local

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self.slice(i)
    k, j = divmod(int(i), self._local)
    return self._parent[k * self._global + self._start + j]

  def __str__(self) -> str:
    return f"ProcessRows(global={self._global}, start={self._start}, local={self._local})"
