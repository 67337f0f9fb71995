"""What differs between the scheduling policies: the waiting queue's order and the prefill chunk size.

The scheduler's mechanics (grants, blocks, preemption) are shared; a policy only decides which
queued request is admitted next (`FcfsQueue`, `SloQueue`) and, under slo, how many prefill tokens a
step that carries decodes may take (`ChunkSizer`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from moeserve.scheduler.request import Request
from moeserve.scheduler.step_time import StepShape, StepTimeModel


class WaitingQueue(Protocol):
    """Requests holding no KV blocks (WAITING or PREEMPTED), head first."""

    def __len__(self) -> int: ...

    def add(self, request: Request) -> None:
        """Queue a new request."""

    def requeue(self, request: Request) -> None:
        """Queue a request just preempted from the running batch."""

    def remove(self, request: Request) -> None:
        """Drop a queued request (it finished while waiting)."""

    def refresh(self) -> None:
        """Re-rank for the current time, before a step admits from the head."""

    def head(self) -> Request:
        """The next request to admit (the queue is not empty)."""

    def pop(self) -> Request:
        """Remove and return `head()`."""

    def ahead_of(self, request: Request) -> list[Request]:
        """The queued requests that will be admitted before `request`, were it queued now."""


def _priority(request: Request) -> int:
    return request.sampling_params.priority


class FcfsQueue:
    """Arrival order, with preempted requests back at the head: they arrived before everyone still
    queued, and the most recently admitted is preempted first, so arrival order holds throughout.
    A request with a lower `priority` goes ahead of those queued with a higher one (vLLM's
    meaning); with every priority equal, as by default, that is plain arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, request: Request) -> None:
        self._queue.insert(self._after_priority(_priority(request)), request)

    def requeue(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def refresh(self) -> None:
        """Arrival order does not change with time."""

    def head(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def ahead_of(self, request: Request) -> list[Request]:
        """Everyone queued with its priority or a lower one."""
        return list(self._queue)[: self._after_priority(_priority(request))]

    def _after_priority(self, priority: int) -> int:
        """Index after the last queued request of `priority` or lower (the tail, as a rule)."""
        index = len(self._queue)
        while index and _priority(self._queue[index - 1]) > priority:
            index -= 1
        return index


class SloQueue:
    """Three lanes, served in this order:
    1. streaming: preempted after emitting tokens, in admission order. Their clients already see
       a stream, and every step they wait adds to one time between tokens.
    2. on time: TTFT deadline (arrival + the request's own TTFT target, else `ttft_s`) not yet
       passed, earliest deadline first, so a tight target overtakes loose ones queued before it.
    3. late: deadline passed, earliest deadline first (with one TTFT target: oldest first).
       A request that can no longer meet its target goes behind those that still can, so under
       overload one late request does not make every later one late too; under sustained
       overload the late lane waits for a lull, `max_waiting` or the client's patience.

    Within a lane a lower `priority` goes first, then the earlier deadline (priorities are all 0
    unless clients set them). A request preempted before its first token still waits for it, so
    it rejoins by deadline.
    Time moves requests from the head of the on-time lane to the late lane only, so both stay
    sorted by inserting from the tail, which is where arrivals almost always belong.
    """

    def __init__(self, ttft_s: float, clock: Callable[[], float]) -> None:
        self._ttft_s = ttft_s
        self._clock = clock
        self._streaming: deque[Request] = deque()
        self._on_time: deque[Request] = deque()
        self._late: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._streaming) + len(self._on_time) + len(self._late)

    def deadline(self, request: Request) -> float:
        """When `request` must have its first token to meet its TTFT target."""
        slo = request.sampling_params.slo
        return request.arrival_time + (self._ttft_s if slo is None else slo.ttft_s)

    def add(self, request: Request) -> None:
        self._insert_by_deadline(self._on_time, request)

    def requeue(self, request: Request) -> None:
        if request.num_output_tokens:
            # Victims go newest first, so pushing each to the front keeps admission order.
            self._streaming.appendleft(request)
        else:
            self._insert_by_deadline(self._on_time, request)

    def remove(self, request: Request) -> None:
        for lane in (self._streaming, self._on_time, self._late):
            if request in lane:
                lane.remove(request)
                return
        raise ValueError(f"request {request.request_id!r} is not queued")

    def refresh(self) -> None:
        """Move requests whose deadline has passed from the on-time lane to the late lane."""
        if not self._on_time:
            return
        now = self._clock()
        if _priority(self._on_time[0]) != _priority(self._on_time[-1]):  # a deadline passed may hide behind
            for request in [r for r in self._on_time if self.deadline(r) < now]:
                self._on_time.remove(request)
                self._insert_by_deadline(self._late, request)
            return
        while self._on_time and self.deadline(self._on_time[0]) < now:
            self._insert_by_deadline(self._late, self._on_time.popleft())

    def head(self) -> Request:
        return self._first_lane()[0]

    def pop(self) -> Request:
        return self._first_lane().popleft()

    def ahead_of(self, request: Request) -> list[Request]:
        """Streams first; then, while its deadline is ahead, the on-time requests due no later;
        once it is past, every on-time request and the late ones due no later."""
        key = self._key(request)
        due = [r for r in self._on_time if self._key(r) <= key]
        if key[1] >= self._clock():
            return [*self._streaming, *due]
        return [*self._streaming, *self._on_time, *(r for r in self._late if self._key(r) <= key)]

    def _key(self, request: Request) -> tuple[int, float]:
        return _priority(request), self.deadline(request)

    def _first_lane(self) -> deque[Request]:
        return self._streaming or self._on_time or self._late

    def _insert_by_deadline(self, lane: deque[Request], request: Request) -> None:
        """Insert after every request of a lower priority, or the same and an earlier or equal
        deadline (FIFO among ties)."""
        key = self._key(request)
        index = len(lane)
        while index and self._key(lane[index - 1]) > key:
            index -= 1
        lane.insert(index, request)


SLO_STEP_HEADROOM = 0.8
"""Share of the TBT target a step is sized to: a token's gap is the step plus the engine's work
between steps, and the step-time model errs by several percent either way. Sized to the target
itself, steps put the TBT p99 right at the target and most streams had a gap just over it
(bench/slo_vs_fcfs.py), which fails the per-request "every gap met" attainment."""


@dataclass
class ChunkSizer:
    """Sizes prefill chunks so a step that carries decodes stays within a TBT target.

    Each decode's next token waits for the whole step, prefill chunks included, so the step's
    prefill gets the largest number of tokens whose predicted step time fits `tbt_s`: the tightest
    TBT target among the step's decodes, less `SLO_STEP_HEADROOM`. At least
    `min_prefill_tokens` of prefill go into every step, whatever the prediction, so prompts keep
    moving when the decodes alone already miss the target (or the model overestimates).
    """

    model: StepTimeModel
    min_prefill_tokens: int

    def chunk_tokens(
        self, shape: StepShape, start_position: int, most: int, num_prefill_granted: int, tbt_s: float
    ) -> int:
        """Tokens, at most `most`, for a prefill chunk from `start_position` joining a step of
        `shape` that already holds `num_prefill_granted` prefill tokens, whose decodes' tightest
        TBT target is `tbt_s`; 0: not in this step."""
        floor = min(most, max(0, self.min_prefill_tokens - num_prefill_granted))
        return max(floor, self._largest_within(shape, start_position, most, tbt_s * SLO_STEP_HEADROOM))

    def _largest_within(self, shape: StepShape, start_position: int, most: int, limit_s: float) -> int:
        """Bisection: predicted time grows with the chunk, as the model's coefficients are >= 0."""
        low, high = 0, most
        while low < high:
            middle = (low + high + 1) // 2
            if self.model.predict(shape.plus_chunk(middle, start_position)) <= limit_s:
                low = middle
            else:
                high = middle - 1
        return low
