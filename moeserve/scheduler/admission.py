"""Admission that keeps promises: predict a new request's TTFT before queueing it.

A server that queues every request and misses the targets of many is worse than one that says at
once "not within your target" (Mooncake's early rejection): the client can go elsewhere or
retry. The prediction uses the slo policy's step-time model and what is ahead of the request:
- the prefill tokens of every queued request that will be admitted first (`WaitingQueue.ahead_of`),
  the rest of the running prefill, and the request's own prompt;
- the running decodes, which share every step with that prefill. While they decode, a step's
  prefill is the chunk the TBT targets allow (slo) or what the token budget leaves (fcfs).
So the prediction is: time already waited + steps * predicted step time, with steps = prefill
tokens / tokens per step. It ignores decodes finishing (they free room: pessimistic) and
requests admitted after it turning into decodes (optimistic); `record_first_token` keeps score
of how often "predicted on time" came true, which tests hold to >= 95%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeserve.scheduler.policy import SLO_STEP_HEADROOM, ChunkSizer
from moeserve.scheduler.step_time import StepShape, StepTimeModel

MIN_RETRY_AFTER_S = 1
"""Retry-After is in whole seconds, and at least one."""


class SLORejectedError(RuntimeError):
    """The step-time model predicts the request's TTFT target would be missed (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = MIN_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = max(MIN_RETRY_AFTER_S, int(retry_after_s))


@dataclass(frozen=True)
class Backlog:
    """What stands between a new request and its first token."""

    prefill_tokens: int
    """Tokens to prefill before its first token: the queue ahead, the running prefill, its own."""
    decodes: StepShape
    """The running decodes, as a step shape (one token each from its context's end)."""
    num_decodes: int
    tightest_tbt_s: float
    """The tightest TBT target among the running decodes (and the request's own)."""
    waited_s: float
    """Time since the request arrived."""


@dataclass(frozen=True)
class TTFTPrediction:
    ttft_s: float
    clear_s: float
    """How long the backlog ahead of the request takes to clear: a fair Retry-After."""


def predict_ttft(model: StepTimeModel, sizer: ChunkSizer | None, backlog: Backlog, budget: int) -> TTFTPrediction:
    """TTFT of a request behind `backlog`, for a step token budget `budget` (the model is ready).

    The step time is divided by `SLO_STEP_HEADROOM`, as the chunk sizer multiplies the target by it:
    a token waits for the step and for the engine's work between steps, which the model never sees.
    """
    per_step = max(1, min(budget - backlog.num_decodes, backlog.prefill_tokens))  # a step holds no more than there is
    if sizer is not None and backlog.num_decodes:
        per_step = max(1, sizer.chunk_tokens(backlog.decodes, 0, per_step, 0, backlog.tightest_tbt_s))
    step_s = model.predict(backlog.decodes.plus_chunk(per_step, 0)) / SLO_STEP_HEADROOM
    clear_s = math.ceil(backlog.prefill_tokens / per_step) * step_s
    return TTFTPrediction(backlog.waited_s + clear_s, clear_s)


@dataclass
class AdmissionTally:
    """How the predictions of admitted requests turned out: of those predicted to meet their TTFT
    target (and admitted on that promise), how many did."""

    predicted_on_time: int = 0
    on_time: int = 0
    rejected: int = 0
    best_effort: int = 0

    def record_first_token(self, predicted_on_time: bool, ttft_s: float, target_s: float) -> None:
        if predicted_on_time:
            self.predicted_on_time += 1
            self.on_time += ttft_s <= target_s
