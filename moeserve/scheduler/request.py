"""One generation request as the scheduler sees it: token ids, KV bookkeeping and status.

A `Request` is a single sequence. A client's `n > 1` is fanned out into n requests by the caller,
so the scheduler never reads `SamplingParams.n`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from moeserve.sampling_params import SamplingParams
from moeserve.spec_decode.ngram import NgramProposer


class RequestStatus(enum.Enum):
    """Where a request is in its life. WAITING and PREEMPTED requests sit in the waiting queue
    holding no KV blocks; WAITING_FOR_REMOTE_KV requests hold the blocks their KV from another
    instance is being loaded into, in neither queue; RUNNING requests hold blocks; the FINISHED_*
    states are terminal."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})

# The terminal status behind each OpenAI `finish_reason`.
STATUS_BY_FINISH_REASON: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass
class Request:
    """A sequence's tokens and the scheduler's state for it.

    The tokens to run are always `all_token_ids[num_computed_tokens:]`: the prompt while
    prefilling, the last sampled token while decoding, and prompt plus outputs after a preemption
    (recompute). `block_ids[i]` holds the KV of positions `[i * block_size, (i + 1) * block_size)`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    """Token ids that end the sequence (generation_config.json may list several)."""
    arrival_time: float
    """When the request reached the server, from a monotonic clock (for queueing-time metrics)."""

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (advanced by `Scheduler.update`, reset by preemption)."""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained content hashes of the request's first full blocks of tokens, as far as prefix
    caching has needed them (`block_hash.block_hashes`); they depend on the tokens alone, so they
    outlive preemption."""
    finish_reason: str | None = None
    """OpenAI finish reason once finished: "stop", "length" or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request; None for EOS or length."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    """When the request first ran (arrival -> first schedule is its queueing time)."""
    announced: bool = False
    """Whether the runners hold its sampling state (sent in a plan's `new_requests`): from its
    first admission on, until a lost rank makes them start afresh (`Scheduler.lose_step`)."""
    predicted_ttft_s: float | None = None
    """The TTFT admission predicted for it (`slo_admission` on and the step-time model ready)."""
    best_effort: bool = False
    """Admitted although its TTFT target was predicted to be missed (`slo_admission="degrade"`)."""
    kv_hold_id: str | None = None
    """On a prefill instance: the transfer its prompt's KV blocks are held for once it finishes,
    until a decode instance has pulled them (`kv_transfer`)."""
    needs_remote_kv: bool = False
    """On a decode instance: its prompt's KV is to be loaded from a prefill instance when it is
    admitted (cleared once the load is asked for: a request loads at most once)."""
    ngram_proposer: NgramProposer | None = field(default=None, repr=False, compare=False)
    """Its prompt-lookup state while it drafts with ngram (`Scheduler._ngram_proposer`), kept with
    the request so that it lives exactly as long, across preemptions too (tokens only grow)."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        kv = self.sampling_params.kv_transfer
        if kv is not None:
            self.kv_hold_id = kv.transfer_id if kv.remote is None else None
            self.needs_remote_kv = kv.remote is not None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_between(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without concatenating the whole sequence, which matters
        when a long request decodes one token per step."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - num_prompt]
