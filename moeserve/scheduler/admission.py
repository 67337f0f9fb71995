"""Admission that keeps promises: predict a new request's TTFT before queueing it.

A server that queues every request and misses the targets of many is worse than one that says at
once "not within your target" (Mooncake's early rejection): the client can go elsewhere or
retry. The prediction is the time already waited plus `first_token.project_first_token`: the
scheduler played forward with the step-time model until the request's prefill is done, so it
waits for a seat, for KV blocks and for the prefill ahead as the scheduler will make it wait.
`record_first_token` keeps score of how often "predicted on time" came true (the engine
exports the two counts on /metrics), which tests hold to >= 90-95%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_RETRY_AFTER_S = 1
"""Retry-After is in whole seconds, and at least one."""


class SLORejectedError(RuntimeError):
    """The step-time model predicts the request's TTFT target would be missed (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = MIN_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = max(MIN_RETRY_AFTER_S, int(retry_after_s))


def retry_after_s(wait_s: float, ttft_target_s: float) -> int:
    """When a refused request, sent again, is predicted to make its target: the backlog ahead
    of it has then moved on by the time it missed by (if nothing else arrives meanwhile). Its
    whole wait would tell the client to stay away longer than it needs to."""
    return max(MIN_RETRY_AFTER_S, math.ceil(wait_s - ttft_target_s))


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
