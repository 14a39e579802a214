"""The pipeline schedule: which stage works on what, at which iteration, and the bubble.

S stages, M microbatches, R circular repeats (R = 1: the plain GPipe schedule).
Every iteration all S stages run at once (one vmapped stage body, the stage dim
split over the `stage` mesh axis); between iterations the activation buffer
shifts right by one stage. Stage s at iteration t works on item k = t - s of
the sequence (microbatch 0, repeat 0), (microbatch 1, repeat 0), ...,
(microbatch M-1, repeat R-1), i.e. microbatch k % M in repeat k // M, and
idles (the bubble) when k is outside [0, M*R):

    buffer = zeros[S, ...]; outs = []
    for t in range(M*R + S - 1):
      m = t % M
      waiting.push(buffer[S-1])                          # R > 1: FIFO of M - S (+ this one)
      buffer = shift_right(buffer)                       # stage s gets stage s-1's output
      buffer[0] = inputs[m] if t < M else waiting.pop()  # repeat r > 0 re-enters stage 0
      buffer = vmap(stage_body)(weights, buffer, repeat=(t - arange(S)) // M)
      outs.append(buffer)                                # a scan output, not a carry
    return [outs[t][S-1] for t in the last M iterations] # = each microbatch's final output

Circular (interleaved) schedule, R > 1: stage s holds R chunks of L/(S*R)
layers, layer index r*(S*L/(S*R)) + s*L/(S*R) + j for chunk r, so one pass over
the S stages runs L/R layers and a microbatch makes R passes. Microbatch m
leaves stage S-1 after repeat r at iteration r*M + m + S - 1 and re-enters stage
0 at (r+1)*M + m, which is not earlier only if M >= S: the circular schedule
needs M >= S. The queue `waiting` (circular.py) keeps it in between: M - S iterations
more than the buffer's shift (none when M = S).

Delayed shift (delay_shift=True, MaxText's delayed activation forwarding): stage s
takes at iteration t what stage s-1 made at t-2, not t-1, so the shift of an
iteration's outputs depends on nothing computed in the next iteration and runs
beside it (an asynchronous collective-permute with the stage body between its start
and done) instead of between two iterations. Every hop takes h = 2 iterations:
stage s works on item k = t - h*s, the loop runs M*R + h*(S-1) iterations, the
bubble is h*(S-1)/(M*R + h*(S-1)), and the circular schedule needs M >= h*S. It
pays where a shift costs more than the extra bubble: stages over DCN.

Bubble: each stage is busy M*R of the M*R + S - 1 iterations, so the idle
fraction is (S - 1) / (M*R + S - 1). An iteration of the circular schedule runs
1/R of the layers of a plain one, so R repeats shrink the bubble like R times
more microbatches would, without making the microbatches smaller.
"""

from __future__ import annotations

import dataclasses


class PipelineError(ValueError):
  """A pipeline shape that cannot work; the message names the setting and the fix."""


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int
  microbatches: int
  repeats: int = 1
  delay_shift: bool = False

  def __post_init__(self):
    s, m, r = self.stages, self.microbatches, self.repeats
    if min(s, m, r) < 1:
      raise PipelineError(f"pipeline stages={s}, microbatches={m}, circular_repeats={r} must be >= 1")
    if r > 1 and self.delay_shift and m < 2 * s:
      raise PipelineError(
          f"model.pipeline.microbatches={m} < 2 x stages={2 * s}: the circular schedule with "
          f"delay_shift=True takes two iterations per hop, so a microbatch needs 2 x stages "
          f"iterations to come round; raise microbatches or set delay_shift=False")
    if r > 1 and m < s:
      raise PipelineError(
          f"model.pipeline.microbatches={m} < stages={s}: the circular schedule (circular_repeats="
          f"{r}) needs microbatches >= stages, since a microbatch re-enters stage 0 M iterations "
          f"after it entered it and must have left the last stage by then; raise microbatches")

  @property
  def hop(self) -> int:
    """Iterations from one stage's output to the next stage's input: 1, or 2 delayed."""
    return 2 if self.delay_shift else 1

  @property
  def iterations(self) -> int:
    """M*R + h*(S - 1) loop iterations fill, run and drain the pipeline."""
    return self.microbatches * self.repeats + self.hop * (self.stages - 1)

  @property
  def bubble_fraction(self) -> float:
    """Idle share of every stage: h*(S - 1) / (M*R + h*(S - 1))."""
    return self.hop * (self.stages - 1) / self.iterations

  def item(self, t, s):
    """The work item stage s runs at iteration t (numpy or jax ints); bubble outside [0, M*R)."""
    return t - self.hop * s

  def work(self, t: int, s: int) -> tuple[int, int] | None:
    """(microbatch, repeat) stage s runs at iteration t, or None in the bubble."""
    k = self.item(t, s)
    if not 0 <= k < self.microbatches * self.repeats:
      return None
    return k % self.microbatches, k // self.microbatches

  def check_batch(self, batch: int) -> int:
    """Rows per microbatch; the batch reaching the layers must split into M equal parts."""
    if batch % self.microbatches:
      raise PipelineError(
          f"the batch of {batch} rows reaching the pipeline (train.global_batch / "
          f"train.microbatches) is not divisible by model.pipeline.microbatches="
          f"{self.microbatches}; pick a global batch that is a multiple of it")
    return batch // self.microbatches


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1, delay_shift: bool = False) -> float:
  """h*(S - 1) / (M*R + h*(S - 1)): the predicted idle fraction of a pipelined step."""
  return Schedule(stages, microbatches, repeats, delay_shift).bubble_fraction
