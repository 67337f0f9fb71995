"""When will a new request's first token come? The scheduler played forward, event by event.

A request waits for three things, and the one that binds changes with the load:
- a seat: with `max_num_seqs` sequences running, it waits until enough of them finish;
- KV blocks: until enough are free for it and for everyone admitted before it;
- prefill: every prompt ahead of it in the queue, the running prefill and its own, at the
  tokens per step that the running decodes and their TBT targets leave.
A closed formula gets one of these right and the others wrong (prefill tokens / tokens per step
promised a 150 ms first token to a request that waited 600 ms for a seat), so this projects the
scheduler instead: the running sequences and the queue ahead, in the order the queue admits
them, stepped forward with the step-time model until the request's prefill is done.

What it assumes, all on the side of a later first token, so that a promise made is kept:
- Every running or queued sequence runs to its `max_tokens` (to `max_model_len` without one): a
  stop token or string is unknown in advance, and counting on one would promise what a long
  answer breaks. A load of short answers to generous `max_tokens` is refused more than it
  needs to be: the price of a promise.
- A sequence holds the KV blocks of its whole length, prompt plus `max_tokens`, from its
  admission: the scheduler admits on a first chunk's blocks and preempts the newest when a
  decode finds none free, so in the long run what runs together is what fits at full length,
  and anything more is recomputed later. The new request needs only its prompt's blocks (its
  first token is sampled before it grows); cached prefixes are not counted.
- Nobody arriving later overtakes it, and nobody is preempted to make room for it (the slo
  policy's yield to a tight request can only bring its first token earlier).
Time is the step-time model's, divided by `SLO_STEP_HEADROOM` as chunk sizing does: a token
also waits for the engine's work between steps, which the model never sees.

Steps between two events (a sequence admitted, a prefill done, a sequence finished) have the same
batch, and a step's predicted time is linear in its KV reads, which grow by the same amount each
step: so a run of k steps costs k times the mean of its first and last step, and a projection
takes a few model evaluations per sequence ahead, not per step.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from moeserve.scheduler.policy import SLO_STEP_HEADROOM, ChunkSizer
from moeserve.scheduler.step_time import StepShape, StepTimeModel


@dataclass(frozen=True)
class Work:
    """What one sequence has left to do, as the projection sees it."""

    prefill_tokens: int
    """Tokens to feed before it samples again: 0 for a decode, the rest of a prompt (plus
    outputs to recompute, after preemption) otherwise."""
    position: int
    """Tokens already in its KV cache (`num_computed_tokens`)."""
    outputs: int
    """Tokens it still samples, the one after its prefill included (>= 1)."""
    blocks: int
    """KV blocks it holds at its longest (see the module's assumptions)."""


@dataclass(frozen=True)
class Capacity:
    """What a data-parallel group's scheduler can hold at once."""

    max_num_seqs: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    decode_tokens: int = 1
    """Tokens a decode feeds a step: 1, or with speculative decoding 1 + the drafts it may carry.
    The projection has each decode feed them all and gain one token a step (every draft
    rejected): a speculative step's cost, on the side of a later first token."""


WAIT_REASONS = ("a seat", "KV blocks", "prefill")


@dataclass(frozen=True)
class FirstToken:
    """A projected first token."""

    wait_s: float
    """Seconds from now until it is sampled."""
    waits_on: dict[str, float]
    """Of those, the seconds spent waiting for each of `WAIT_REASONS`: a seat or KV blocks
    before admission, prefill (its own and that of the sequences ahead) after it."""

    @property
    def bottleneck(self) -> str:
        """What it waits for longest."""
        return max(WAIT_REASONS, key=lambda reason: self.waits_on[reason])


def project_first_token(
    model: StepTimeModel,
    sizer: ChunkSizer | None,
    capacity: Capacity,
    running: Sequence[Work],
    ahead: Sequence[Work],
    own: Work,
    tbt_s: float,
) -> FirstToken:
    """When `own`'s first token comes, behind `running` (in admission order) and `ahead` (the
    queued sequences admitted before it, head first). `tbt_s`, the tightest TBT target among
    them, sizes the prefill chunks that share a step with decodes (`sizer`; None: fcfs, the
    whole budget). The model must be ready."""
    return _Projection(model, sizer, capacity, tbt_s).run(running, ahead, own)


class _Prefill:
    """An admitted sequence still feeding its prompt."""

    __slots__ = ("remaining", "position", "work")

    def __init__(self, work: Work) -> None:
        self.remaining = work.prefill_tokens
        self.position = work.position
        self.work = work


class _Projection:
    """The scheduler's state, stepped from event to event.

    Decodes are kept as a heap of the steps they finish at; their contexts all grow by one a
    step, so their total KV length is `_kv_offset + decodes * step`, with no per-step update.
    """

    def __init__(self, model: StepTimeModel, sizer: ChunkSizer | None, capacity: Capacity, tbt_s: float) -> None:
        self.model = model
        self.sizer = sizer
        self.capacity = capacity
        self.tbt_s = tbt_s
        self.step = 0
        self.elapsed_s = 0.0
        self.seats = 0
        self.blocks = 0
        self.decodes: list[tuple[int, int, int]] = []  # (finish step, context - step at start, blocks)
        self._kv_offset = 0
        self.prefills: deque[_Prefill] = deque()
        self.pending = 0  # prefill tokens left in `prefills`
        self.queue: deque[Work] = deque()
        self.waits_on = dict.fromkeys(WAIT_REASONS, 0.0)

    def run(self, running: Sequence[Work], ahead: Sequence[Work], own: Work) -> FirstToken:
        for work in running:
            self._seat(work)
        self.queue.extend(ahead)
        self.queue.append(own)
        while True:
            self._admit()
            steps, chunk, head_position = self._next_run()
            duration_s = steps * self._mean_step_s(steps, chunk, head_position)
            self.elapsed_s += duration_s
            self.waits_on[self._waiting_for()] += duration_s
            self.step += steps
            if self._feed(steps * chunk, own):
                return FirstToken(self.elapsed_s, self.waits_on)
            self._finish_decodes()

    def _seat(self, work: Work) -> None:
        """Take a seat and blocks for `work`, as a prefill or (nothing left to feed) a decode."""
        self.seats += 1
        self.blocks += work.blocks
        if work.prefill_tokens:
            self.prefills.append(_Prefill(work))
            self.pending += work.prefill_tokens
        else:
            self._decode(work.position, work.outputs, work.blocks)

    def _decode(self, context: int, outputs: int, blocks: int) -> None:
        heapq.heappush(self.decodes, (self.step + outputs, context - self.step, blocks))
        self._kv_offset += context - self.step

    def _admit(self) -> None:
        """Queue head first while a seat and its blocks are free. A sequence alone always fits
        (the scheduler's config makes sure), so an empty batch admits the head: something always
        runs, and the projection always moves on."""
        capacity = self.capacity
        while self.queue and self.seats < capacity.max_num_seqs:
            head = self.queue[0]
            if self.seats and self.blocks + head.blocks > capacity.num_kv_blocks:
                return
            self._seat(self.queue.popleft())

    def _waiting_for(self) -> str:
        """Why the new request, last in the queue until admitted, has no first token yet: the
        queue's head waits for a seat or for blocks (admission stops only there), or it is
        admitted and prefill is under way."""
        if not self.queue:
            return "prefill"
        return "a seat" if self.seats >= self.capacity.max_num_seqs else "KV blocks"

    def _chunk(self, decode_shape: StepShape, num_decodes: int, head_position: int) -> int:
        """Prefill tokens a step carries: the budget left by the decodes, at most what is
        pending, cut to the TBT target while there are decodes (slo)."""
        most = min(self.capacity.max_num_batched_tokens - num_decodes * self.capacity.decode_tokens, self.pending)
        if self.sizer is not None and num_decodes:
            most = self.sizer.chunk_tokens(decode_shape, head_position, most, 0, self.tbt_s)
        return max(1, most)

    def _decode_shape(self, num_decodes: int) -> StepShape:
        """The running decodes, `decode_tokens` each (their last token and its drafts), at this step."""
        fed = self.capacity.decode_tokens
        contexts = self._kv_offset + num_decodes * self.step  # before this step's tokens
        pairs = fed * contexts + num_decodes * fed * (fed + 1) // 2
        return StepShape(num_decodes * fed, num_decodes, contexts + num_decodes * fed, pairs)

    def _next_run(self) -> tuple[int, int, int]:
        """(steps until the next event, prefill tokens per step, position of the head prefill)."""
        num_decodes = len(self.decodes)
        steps = self.decodes[0][0] - self.step if self.decodes else math.inf
        if not self.prefills:
            return int(steps), 0, 0
        head = self.prefills[0]
        chunk = self._chunk(self._decode_shape(num_decodes), num_decodes, head.position)
        return int(min(steps, -(-head.remaining // chunk))), chunk, head.position

    def _mean_step_s(self, steps: int, chunk: int, head_position: int) -> float:
        """Mean predicted time of the next `steps` steps: each reads every decode's context one
        longer, and the prefill chunk's `chunk` further in, so time is linear in the step index."""
        num_decodes = len(self.decodes)
        first = self._decode_shape(num_decodes)
        if chunk:
            first = first.plus_chunk(chunk, head_position)
        more = steps - 1
        last = StepShape(
            first.num_tokens,
            first.num_seqs,
            first.num_kv_reads + (num_decodes + chunk) * more,
            first.num_attention_pairs + (num_decodes * self.capacity.decode_tokens + chunk * chunk) * more,
        )
        return (self.model.predict(first) + self.model.predict(last)) / 2 / SLO_STEP_HEADROOM

    def _feed(self, tokens: int, own: Work) -> bool:
        """Hand `tokens` of prefill to the admitted prompts in order; each one done samples its
        first token and decodes on, or finishes. True when `own`'s is done."""
        while tokens and self.prefills:
            head = self.prefills[0]
            taken = min(tokens, head.remaining)
            head.remaining -= taken
            head.position += taken
            self.pending -= taken
            tokens -= taken
            if head.remaining:
                return False
            self.prefills.popleft()
            if head.work is own:
                return True
            if head.work.outputs > 1:
                self._decode(head.position, head.work.outputs - 1, head.work.blocks)
            else:
                self._release(head.work.blocks)
        return False

    def _finish_decodes(self) -> None:
        while self.decodes and self.decodes[0][0] <= self.step:
            _, offset, blocks = heapq.heappop(self.decodes)
            self._kv_offset -= offset
            self._release(blocks)

    def _release(self, blocks: int) -> None:
        self.seats -= 1
        self.blocks -= blocks
