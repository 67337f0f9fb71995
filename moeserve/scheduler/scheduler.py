"""Continuous batching: which requests run in each engine step, with which tokens and KV blocks.

In one engine step `schedule()` and `update()` strictly alternate; in between, the engine runs the
plan, and hands back the sampled tokens and how long the step took, which the slo policy learns from:

    output = scheduler.schedule()                          # per request: tokens, positions, block table
    sampled = runner.execute(output)                       # {request_id: token_id} for every `sample=True`
    finished = scheduler.update(output, sampled, seconds)  # append tokens, check stops, free blocks

The plan is all the runners ever learn of requests: it carries each request's sampling data once,
when the request is first scheduled, and its id once more after it finished, so whoever keeps
per-request state (a rank's copy of the tokens, a seeded generator) knows when to make and drop it.

Mechanics shared by both policies: iteration-level batching, preemption by recompute.
- Running requests go first, in admission order: every decode costs one token of the step's
  budget, and a request still prefilling in chunks takes its next chunk from what is left.
- Then waiting requests are admitted from the head of the queue while the budget,
  `max_num_seqs` and free blocks allow; with chunked prefill a prompt larger than what is left is
  split, and nothing is admitted after a split prompt. Admission stops at the first request that
  does not fit, so nobody overtakes the queue head.
- When a running request needs a block and none is free, the most recently admitted running
  request is preempted: its blocks are freed and it is requeued, to recompute prompt plus
  outputs when readmitted. No admission happens in a step that preempted.
- Prefix caching (`enable_prefix_caching`): a request being admitted takes the cached blocks of
  its longest cached prefix of full blocks (`BlockManager.lookup`, never its last token) and
  starts computing after them, like a chunked prefill whose first chunks someone else ran; a
  readmitted request finds its own blocks again if they were not evicted meanwhile. `update`
  registers every block a step filled, prompt or output. A queued request whose prefix is being
  computed in this very step waits for the next one, which finds it cached.
  A model whose layers keep a state per sequence (`has_state`) resumes a hit from a saved state
  (`saved_states.py`): the plan marks the steps that end where a state is saved (every
  `state_save_interval` blocks, and the last block boundary before a prompt's last token; with
  several block-table groups only a boundary of every group, `hit_alignment`; a prompt chunk
  crossing one is cut there) with the slot to write (`ScheduledRequest.save_state`),
  `update` makes it findable, and a hit names the slot its sequence starts from (`load_state`).

- KV loaded from another instance (a decode instance of prefill/decode disaggregation): a request
  whose prompt's KV a prefill instance computed is admitted like any other, from the queue's head,
  with its cached prefix and fresh blocks for the rest of its prompt's full blocks taken by the
  same `allocate`, but instead of running it waits for that KV in `_loading`
  (WAITING_FOR_REMOTE_KV) while others run, and the plan asks the engine to load it
  (`SchedulerOutput.kv_loads`). Once loaded (`finish_kv_load`) its blocks are registered in the
  prefix cache and released, and it goes back to the queue's head, whose admission finds them
  cached and computes only its last partial block; a failed load releases them unregistered and
  it recomputes its prompt. No queued request holds blocks, so none waits on another that does.
  A model with state layers also reserves a saved-state slot for the prompt's state at its last
  loaded block (`KvLoad.state_slot`), which the load's end makes findable, so that admission
  resumes from it as from any hit. A load ends at the prompt's mark (`_prompt_mark`): its last
  full block with one group; with several (`GroupedBlockManager.allocate_load`) its last
  `hit_alignment` position, each group's table up to it (`KvLoad.group_block_ids`).

- Speculative decoding (`SchedulerConfig.speculative`): a decode whose drafts can be verified
  exactly feeds n-gram drafts (or slots the runner's MTP layers fill) after its last token, out
  of the budget left once every later running request has its token, and only with blocks free
  (drafts never preempt). `update` takes
  the kept drafts and the sampled token, appends them through the stop rules, counts only them as
  computed and releases the blocks past them (`BlockManager.trim`).

Policies (`SchedulerConfig.policy`) differ only in the queue's order and the size of prefill:
- fcfs: the queue is in arrival order (preempted requests at its head) and every step may fill
  `max_num_batched_tokens`. Best throughput, but while a long prompt is chunked every running
  stream waits a full-budget step for each token.
- slo: the engine reports each step's wall time (with `update`) to a `StepTimeModel`. While any
  running request is decoding, the step's prefill gets only the tokens the model predicts fit in
  `slo_tbt_s` (less a headroom for the work between steps and the model's error), but at least
  one KV block, so prompts always progress; with no decodes nobody's TBT is at stake and the full
  budget goes to prefill, which TTFT wants. Until the model has seen
  enough steps, it sizes like fcfs. The queue (`SloQueue`) serves streams preempted mid-output
  first, then requests by TTFT deadline (arrival + `slo_ttft_s`), then those past it.
  A request's own targets (`SamplingParams.slo`) replace the server's for it: its deadline is
  its own, and a step's prefill fits the tightest TBT target among the step's decodes. When the
  queue's head has used half its TTFT target waiting for a seat or blocks that a stream with
  looser targets (both TTFT and TBT) holds, that stream is preempted to make room and queues
  again by its own deadline, behind the tight request (`_yield_to_tight`).
Admission (`slo_admission`, either policy): a new request whose TTFT target is predicted to be
missed is refused (`SLORejectedError`) or admitted as best effort (`admission.py`); the
prediction plays this scheduler forward with the step-time model, waiting for seats, KV blocks
and the prefill ahead (`first_token.py`).
Progress is guaranteed: `SchedulerConfig` ensures one `max_model_len` sequence fits the cache and
all decodes fit the budget, the earliest admitted running request can preempt every other one,
and a step that can run anything grants at least one token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler.admission import AdmissionTally, SLORejectedError, retry_after_s
from moeserve.scheduler.block_groups import GroupBlockIds, GroupedBlockManager
from moeserve.scheduler.block_hash import BlockHash, block_hashes
from moeserve.scheduler.block_manager import BlockManager
from moeserve.scheduler.config import SchedulerConfig, blocks_for_tokens
from moeserve.scheduler.first_token import Capacity, FirstToken, Work, project_first_token
from moeserve.scheduler.policy import ChunkSizer, FcfsQueue, SloQueue, WaitingQueue
from moeserve.scheduler.request import STATUS_BY_FINISH_REASON, Request, RequestStatus
from moeserve.scheduler.step_time import StepShape, StepTimeModel
from moeserve.spec_decode.ngram import NgramProposer, can_draft


class QueueFullError(RuntimeError):
    """The waiting queue holds `max_waiting` requests; the server should shed this one (HTTP 503)."""


@dataclass(frozen=True)
class ScheduledRequest:
    """What the model runner does for one request in one step."""

    request_id: str
    token_ids: list[int]
    """Tokens to feed: a prompt chunk, the last sampled token, or a recompute after preemption."""
    start_position: int
    """Position of `token_ids[0]`: the request's `num_computed_tokens` before this step."""
    block_ids: list[int]
    """The request's whole block table (a copy); covers `start_position + len(token_ids)` tokens."""
    sample: bool
    """True when this step reaches the end of the sequence, so a next token must be sampled.
    False for every prompt chunk but the last."""
    num_draft_tokens: int = 0
    """How many of `token_ids` (the last ones) are speculative drafts following a decode's last
    token: the runner verifies them and returns the accepted ones before the token it samples."""
    load_state: int = -1
    """A model with state layers: the saved-state slot this sequence's states start from (a
    prefix-cache hit at `start_position`), else -1."""
    save_state: int = -1
    """A model with state layers: the saved-state slot the runner copies this sequence's states
    into once the step has run (they are then the states after `start_position + len(token_ids)`
    positions), else -1."""
    group_tables: dict[tuple[int, int | None], list[int]] = field(default_factory=dict)
    """A model with several block-table groups (DeepSeek-V4): its table per group (`block_groups`;
    a window block given back reads `RELEASED`), `block_ids` then empty. Else empty."""


@dataclass(frozen=True)
class NewRequest:
    """What a runner needs to sample for a request, sent in the plan that first schedules it.

    Sent once in the request's life: the runner keeps it (and appends the tokens it samples)
    until the id comes back in `finished_request_ids`. A preempted request keeps that state
    while it waits, so readmission sends nothing: its seeded generator must go on where it
    stopped, and its tokens on the runner are the scheduler's, sampled there in the first place.
    """

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    """A snapshot, immutable, so every holder (the plan, an in-process runner) can share it."""
    output_token_ids: tuple[int, ...] = ()
    """Tokens it sampled before these runners knew it: none for a new request; those a client has
    already been sent for one announced again after a lost rank (`Scheduler.lose_step`)."""


@dataclass(frozen=True)
class KvLoad:
    """A request's prompt KV to load from another instance into its own blocks."""

    request_id: str
    block_ids: list[int]
    """The blocks to write, in prompt order: the request's full prompt blocks after its cached prefix."""
    first_block: int
    """Which of the prompt's blocks `block_ids[0]` holds (the cached prefix's length)."""
    state_slot: int = -1
    """For a model with state layers, the saved-state slot the prompt's state at its mark
    goes into (`SavedStates.reserve_load`); -1 for none."""
    group_block_ids: GroupBlockIds = ()
    """A model with several block-table groups (`block_ids` empty): per group, its table up to
    the prompt's mark, `RELEASED` where nothing is written (the cached prefix, window blocks
    dead at the mark)."""


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one engine step."""

    scheduled: list[ScheduledRequest]
    """Decodes first, then prefill chunks (continued ones, then newly admitted ones)."""
    num_batched_tokens: int
    """Sum of `len(token_ids)`; at most `max_num_batched_tokens`."""
    preempted_request_ids: list[str]
    """Requests preempted while planning this step (their KV is gone)."""
    new_requests: list[NewRequest]
    """Requests scheduled for the first time in this plan, with what sampling needs of them."""
    finished_request_ids: list[str]
    """Requests that finished since the previous plan: aborted, stopped by `finish_request`, or
    finished in `update`. Runners drop their state before reading `new_requests`, as an id may
    be reused by a new request. An executor must deliver these even with an empty plan."""
    prefix_cache_queries: int = 0
    """Tokens of the requests admitted in this plan (readmissions included), as vLLM counts
    prefix cache queries; 0 without prefix caching."""
    prefix_cache_hits: int = 0
    """Of those, the tokens found in the prefix cache, which the requests do not compute."""
    kv_loads: list[KvLoad] = field(default_factory=list)
    """Requests admitted to wait for their KV from another instance: the engine starts each load
    and reports its end with `finish_kv_load`."""

    @property
    def is_empty(self) -> bool:
        """Nothing to run this step (the finished ids must still reach the runners)."""
        return not self.scheduled


def _is_decode(request: Request) -> bool:
    """Generating: one token left to feed, after outputs a client is already reading."""
    return request.num_tokens - request.num_computed_tokens == 1 and request.num_output_tokens > 0


@dataclass
class _StepLoad:
    """What the chunk sizer needs to know of the grants so far (kept only when there is a sizer,
    as it costs a little per grant)."""

    default_tbt_s: float
    """The TBT target of a request that brings none."""
    shape: StepShape = StepShape()
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    tightest_tbt_s: float = math.inf
    """The tightest TBT target among the step's decodes."""

    def add(self, request: Request, num_tokens: int) -> None:
        self.shape = self.shape.plus_chunk(num_tokens, request.num_computed_tokens)
        if _is_decode(request):
            self.num_decodes += 1
            slo = request.sampling_params.slo
            self.tightest_tbt_s = min(self.tightest_tbt_s, self.default_tbt_s if slo is None else slo.tbt_s)
        else:
            self.num_prefill_tokens += num_tokens


class _StepPlan:
    """Token grants made so far while planning one step."""

    def __init__(self, budget: int, load: _StepLoad | None) -> None:
        self.budget = budget
        self.grants: dict[str, tuple[Request, int]] = {}  # request_id -> (request, num_new_tokens), in grant order
        self.preempted_ids: list[str] = []
        self.new_requests: list[NewRequest] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.split_prefill = False  # a prefill chunk stops short of its sequence's end
        self.drafts: dict[str, list[int]] = {}  # request_id -> draft tokens fed after its last token
        self.kv_loads: list[KvLoad] = []
        self.state_loads: dict[str, int] = {}  # request_id -> saved-state slot its prefix-cache hit starts from
        self.load = load

    def grant(self, request: Request, num_tokens: int) -> None:
        self.split_prefill = self.split_prefill or num_tokens < request.num_tokens - request.num_computed_tokens
        self.grants[request.request_id] = (request, num_tokens)
        self.budget -= num_tokens
        if self.load is not None:
            self.load.add(request, num_tokens)


class Scheduler:
    """Owns every unfinished request and the KV block manager; pure Python, no tensors.

    `clock` stamps first admission (queue time) and, under slo, tells which TTFT deadlines have
    passed; tests pass a fake one. It must share a time base with `Request.arrival_time`.
    `admission` is where admission keeps score; data-parallel groups share one, so the score
    outlives a group lost with its rank.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        admission: AdmissionTally | None = None,
    ) -> None:
        self.config = config
        self.block_manager: BlockManager | GroupedBlockManager
        if config.block_groups:
            keys, counts = zip(*config.block_groups)
            self.block_manager = GroupedBlockManager(
                keys, counts, config.block_size, config.enable_prefix_caching, config.num_saved_states
            )
        else:
            self.block_manager = BlockManager(
                config.num_kv_blocks,
                config.block_size,
                config.enable_prefix_caching,
                config.has_state,
                config.num_saved_states,
            )
        self._clock = clock
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self._waiting: WaitingQueue = SloQueue(config.slo_ttft_s, clock) if config.policy == "slo" else FcfsQueue()
        self._running: list[Request] = []  # RUNNING, in admission order
        self._loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV: blocks held, KV on its way
        sizes_chunks = config.policy == "slo" and config.enable_chunked_prefill
        self._model = StepTimeModel() if sizes_chunks or config.slo_admission != "off" else None
        self._chunk_sizer = ChunkSizer(self._model, config.block_size) if sizes_chunks and self._model else None
        self.admission = admission or AdmissionTally()
        """How admission's TTFT predictions turned out (see `admission.py`)."""
        self._finished_ids: list[str] = []  # finished since the previous schedule()
        self._awaiting_update = False
        self.kv_holds: list[tuple[str, list[int] | GroupBlockIds, int]] = []
        """(transfer id, pinned block ids (per group with several groups), pinned saved-state
        slot or -1) of finished prefill-only requests, for the KV transfer to take over
        (`Request.kv_hold_id`)."""

    # ----- requests in and out -----

    def add_request(self, request: Request, slo_admission: bool = True) -> None:
        """Queue a new request; `slo_admission=False` skips SLO admission, for a request the
        caller has already accepted (its grammar was compiling).

        Raises ValueError for a request that could never complete (duplicate id, not fresh, or
        prompt + max_tokens over `max_model_len`; max_tokens=None needs room for one token), and
        QueueFullError when `max_waiting` requests are already queued, and SLORejectedError when
        `slo_admission="reject"` and its TTFT target is predicted to be missed.
        """
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is {request.status.name}, not WAITING")
        max_tokens = request.sampling_params.max_tokens or 1
        if request.num_prompt_tokens + max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.config.max_model_len})"
            )
        if self.config.max_waiting is not None and len(self._waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        if slo_admission and self.config.slo_admission != "off":
            self._admit_or_refuse(request)
        self._requests[request.request_id] = request
        self._waiting.add(request)

    def _admit_or_refuse(self, request: Request) -> None:
        """Predict `request`'s TTFT; refuse it or mark it best effort if its target is missed.
        With the step-time model not ready yet there is no prediction and the request is admitted."""
        first_token = self.project_first_token(request)
        if first_token is None:
            return
        ttft_s = self._targets(request)[0]
        request.predicted_ttft_s = max(0.0, self._clock() - request.arrival_time) + first_token.wait_s
        if request.predicted_ttft_s <= ttft_s:
            return
        if self.config.slo_admission == "degrade":
            request.best_effort = True
            self.admission.best_effort += 1
            return
        self.admission.rejected += 1
        raise SLORejectedError(
            f"predicted time to first token {request.predicted_ttft_s * 1000:.0f} ms exceeds the request's target "
            f"of {ttft_s * 1000:.0f} ms (waiting mostly for {first_token.bottleneck}: "
            f"{self.num_waiting} requests queued, {self.num_running} running)",
            retry_after_s=retry_after_s(first_token.wait_s, ttft_s),
        )

    def _targets(self, request: Request) -> tuple[float, float]:
        """(TTFT, TBT) targets of `request`: its own, else the server's."""
        slo = request.sampling_params.slo
        return (self.config.slo_ttft_s, self.config.slo_tbt_s) if slo is None else (slo.ttft_s, slo.tbt_s)

    def project_first_token(self, request: Request, model: StepTimeModel | None = None) -> FirstToken | None:
        """When a new `request` would get its first token were it queued here now (see
        `first_token.py`), timed by `model` (default: this scheduler's); None while that model
        is not ready. Data-parallel routing asks every group, each timed by its own speed."""
        model = model or self._model
        if model is None or not model.ready:
            return None
        sizer = self._chunk_sizer
        if sizer is not None and model is not sizer.model:
            sizer = ChunkSizer(model, sizer.min_prefill_tokens)
        ahead = self._waiting.ahead_of(request)
        tbt_s = min(self._targets(r)[1] for r in (request, *self._running, *ahead))
        own = Work(request.num_tokens, 0, 1, blocks_for_tokens(request.num_tokens, self.config.block_size))
        spec = self.config.speculative
        capacity = Capacity(
            self.config.max_num_seqs,
            self.config.num_kv_blocks,
            self.config.max_num_batched_tokens,
            1 if spec is None else 1 + spec.num_speculative_tokens,
        )
        running = [self._work(r) for r in self._running]
        return project_first_token(model, sizer, capacity, running, [self._work(r) for r in ahead], own, tbt_s)

    def _work(self, request: Request) -> Work:
        """What a running or queued request has left, run to its `max_tokens` (or to
        `max_model_len`): a stop token is unknown in advance, and assuming none keeps a
        promise made on the projection."""
        max_model_len = self.config.max_model_len
        max_tokens = request.sampling_params.max_tokens
        length = max_model_len if max_tokens is None else min(request.num_prompt_tokens + max_tokens, max_model_len)
        outputs = max(1, length - request.num_prompt_tokens - request.num_output_tokens)
        prefill = 0 if _is_decode(request) else request.num_tokens - request.num_computed_tokens
        blocks = blocks_for_tokens(length, self.config.block_size)
        return Work(prefill, request.num_computed_tokens, outputs, blocks)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request as "abort" (e.g. the client went away); False if it is not live."""
        return self.finish_request(request_id, "abort")

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> bool:
        """Finish a live request from outside the step, e.g. when the output processor matches a
        stop string. Its blocks are freed now and it is listed in the next plan's
        `finished_request_ids`. Returns False if the request is unknown or already finished."""
        if reason not in STATUS_BY_FINISH_REASON:
            raise ValueError(f"unknown finish reason {reason!r}; expected one of {sorted(STATUS_BY_FINISH_REASON)}")
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, reason, stop_reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Queued requests, and those waiting for their KV from another instance."""
        return len(self._waiting) + len(self._loading)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def backlog_tokens(self) -> int:
        """Tokens still to feed for everything this scheduler holds: the rest of each running
        request's prefill, one for each decode, each queued request's prompt (the prefix cache
        ignored). What token-aware routing compares groups by until it can time them."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self._requests.values())

    @property
    def step_time_model(self) -> StepTimeModel | None:
        """The model sizing prefill chunks (slo) and predicting TTFT (admission), else None."""
        return self._model

    # ----- a lost rank (`--on-rank-failure heal`) -----

    def lose_step(self) -> None:
        """The step in flight was lost with a rank: no `update` comes for it, and the runners
        dropped every request's state. Every running request is preempted, newest first as
        preemption goes, to recompute its prompt and outputs on readmission (its full blocks are
        found again in the prefix cache: the survivors' caches are intact), and every live request
        is announced again, with the tokens it has sampled. Nothing a client was sent changes:
        outputs are only ever appended by `update`, which the lost step never reached."""
        self._awaiting_update = False
        self.block_manager.drop_pending_states()
        while self._running:
            victim = self._running[-1]
            self._requeue_for_recompute(victim)
        for request in self._requests.values():
            request.announced = False

    def release_all(self) -> list[Request]:
        """Hand every live request over (this group is gone with its rank): running ones first, in
        admission order, then the queued ones head first; none holds a block here any more."""
        self.lose_step()
        released = []
        for request in list(self._loading.values()):
            self._give_up_kv_load(request)
        while self._waiting:
            released.append(self._waiting.pop())
        self._requests.clear()
        self._finished_ids.clear()  # their runner is gone with the rank
        return released

    def adopt(self, requests: list[Request]) -> None:
        """Take over requests another group released (`release_all`), in that order: those that
        ran go to the head of the queue as preempted requests do (their clients are reading a
        stream), those that never ran join it as new arrivals."""
        for request in requests:
            if request.request_id in self._requests:
                raise ValueError(f"request id {request.request_id!r} is already in use")
        ran = [r for r in requests if r.status is RequestStatus.PREEMPTED]
        for request in requests:
            self._requests[request.request_id] = request
        for request in reversed(ran):  # requeue pushes to the front: the last first keeps their order
            self._waiting.requeue(request)
        for request in requests:
            if request.status is RequestStatus.WAITING:
                self._waiting.add(request)

    def live_requests(self) -> list[Request]:
        """Every unfinished request of this group."""
        return list(self._requests.values())

    # ----- the step -----

    def schedule(self) -> SchedulerOutput:
        """Plan one step.

        Invariant, on entry and on return:
        - every unfinished request is in exactly one of `_waiting` (WAITING or PREEMPTED, no
          blocks, `num_computed_tokens == 0`), `_loading` (WAITING_FOR_REMOTE_KV, holding its
          prompt's full blocks) and `_running` (RUNNING);
        - a running request's blocks cover positions `[0, num_computed_tokens)`; only cached full
          blocks, which nobody writes again, have several owners; `len(_running) <= max_num_seqs`;
        - `_running` is in admission order and preemption for blocks takes its tail, so that
          victim is always the most recently admitted (slo's yield to a tight request takes a
          looser decode from anywhere, before any grant, leaving the rest in order); under fcfs
          admission pops the queue head and preemption pushes the victim back to the head, so
          `_running + _waiting` is in arrival order;
        - only `_running[-1]` can be mid-prefill: nothing is admitted after a prompt that is split
          (by the budget or, under slo, the TBT target) until its prefill completes;
        - the plan grants at most `max_num_batched_tokens` tokens, each scheduled request's blocks
          cover `start_position + len(token_ids)`, and `num_computed_tokens` only moves in `update`
          and, to the cached prefix, on admission.
        """
        if self._awaiting_update:
            raise RuntimeError("schedule() called again before update() of the previous step")
        load = _StepLoad(self.config.slo_tbt_s) if self._chunk_sizer is not None else None
        plan = _StepPlan(self.config.max_num_batched_tokens, load)
        if self.config.policy == "slo":
            self._yield_to_tight(plan)
        self._schedule_running(plan)
        if not plan.preempted_ids:
            self._admit_waiting(plan)
        output = self._build_output(plan)
        self._awaiting_update = not output.is_empty
        return output

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Mapping[str, int | Sequence[int]],
        duration_s: float | None = None,
    ) -> list[Request]:
        """Apply a step's results: advance each scheduled request's computed tokens, append the
        sampled tokens, and finish requests whose stop rule fires (blocks freed now). A request
        drafting with ngram has its proposer read the step's tokens here (`_ngram_proposer`).

        `sampled_token_ids` must hold a token for every scheduled request with `sample=True`: an
        int, or, for one that drafted, its accepted drafts followed by the sampled token. Only
        verified positions count as computed, so prefix caching never registers a block holding
        a rejected draft; blocks taken for drafts past the kept tokens are released at once.
        Requests aborted or finished while the step ran are skipped. `duration_s`, the step's
        measured wall time (forward plus sampling), teaches slo how long a step of this shape
        takes, so it can size the next prefill chunks; None for a step nobody timed. Returns the
        requests that finished, so the caller can emit their final outputs.
        """
        self._awaiting_update = False
        self.block_manager.commit_saved_states()
        if duration_s is not None:
            self.observe(output, duration_s)
        finished: list[Request] = []
        for scheduled in output.scheduled:
            request = self._requests.get(scheduled.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished while the step ran (the id may even be reused by a new request)
            if not scheduled.sample:
                request.num_computed_tokens += len(scheduled.token_ids)
                self.block_manager.cache_full_blocks(request, scheduled.start_position)
                if self._drafts_ngram(request):
                    self._ngram_proposer(request, request.num_computed_tokens)
                continue
            stop = self._append_tokens(request, sampled_token_ids[scheduled.request_id])
            # Every token but the newest has its KV now: the fed ones and the accepted drafts (the
            # newest is the one sampled, or a kept draft a stop ended on, computed but not needed).
            request.num_computed_tokens = request.num_tokens - 1
            self.block_manager.cache_full_blocks(request, scheduled.start_position)
            if stop is None and self._drafts_ngram(request):
                self._ngram_proposer(request, request.num_tokens)
            if stop is not None:
                self._finish(request, *stop)
                finished.append(request)
            elif scheduled.num_draft_tokens:
                self.block_manager.trim(request, request.num_tokens)
        return finished

    def observe(self, output: SchedulerOutput, duration_s: float) -> None:
        """Teach the step-time model (if any) that a step of `output`'s shape took `duration_s`:
        `update` does for every timed step; the engine's start-up profile (`step_profile`) does
        for steps it planned elsewhere, so that this scheduler predicts before its first request."""
        model = self.step_time_model
        if model is not None and not output.is_empty:
            model.observe(StepShape.of((len(s.token_ids), s.start_position) for s in output.scheduled), duration_s)

    def _append_tokens(self, request: Request, sampled: int | Sequence[int]) -> tuple[str, int | None] | None:
        """Append a step's tokens one by one until one ends the request; its stop rule, if any."""
        for token_id in (sampled,) if isinstance(sampled, int) else sampled:
            request.output_token_ids.append(token_id)
            if request.num_output_tokens == 1 and request.predicted_ttft_s is not None:
                ttft_target_s = self._targets(request)[0]
                on_time = request.predicted_ttft_s <= ttft_target_s
                self.admission.record_first_token(on_time, self._clock() - request.arrival_time, ttft_target_s)
            stop = self._check_stop(request)
            if stop is not None:
                return stop
        return None

    # ----- planning -----

    def _yield_to_tight(self, plan: _StepPlan) -> None:
        """slo: preempt a loose-target stream for the queue's head when the head is a newcomer
        that has used half its TTFT target waiting, cannot get a seat or the blocks of its first
        chunk, and some running decode's TTFT and TBT targets are both looser than its own. The
        victim is the loosest by TBT (then TTFT, then the newest); it requeues as a newcomer would,
        by its own deadline, so the head goes first. The step then admits nobody (as after any
        preemption); the next one admits the head."""
        if not self._waiting:
            return
        self._waiting.refresh()
        head = self._waiting.head()
        ttft_s, tbt_s = self._targets(head)
        if head.num_output_tokens or self._clock() - head.arrival_time < ttft_s / 2 or not self._is_blocked(head):
            return
        looser = [
            (own_tbt_s, own_ttft_s, index, r)
            for index, r in enumerate(self._running)
            if _is_decode(r)
            for own_ttft_s, own_tbt_s in [self._targets(r)]
            if own_ttft_s > ttft_s and own_tbt_s > tbt_s
        ]
        if looser:
            victim = max(looser, key=lambda entry: entry[:3])[3]
            self._preempt(victim, plan)
            self._waiting.remove(victim)
            self._waiting.add(victim)

    def _is_blocked(self, request: Request) -> bool:
        """No seat for `request`, or too few free blocks for its first chunk (cached prefix aside)."""
        if len(self._running) >= self.config.max_num_seqs:
            return True
        first_chunk = min(request.num_tokens, self.config.max_num_batched_tokens)
        return self.block_manager.num_free_blocks < blocks_for_tokens(first_chunk, self.config.block_size)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Grant every running request its next tokens in admission order, preempting from the
        tail when blocks run out. Decodes come first because only the newest request can be
        mid-prefill, so a prefill chunk is sized knowing every decode it shares the step with."""
        index = 0
        while index < len(self._running):  # preemption shortens the list from the tail
            request = self._running[index]
            index += 1
            num_new_tokens = self._num_tokens_to_grant(request, plan)
            assert num_new_tokens > 0, "budget exhausted before every running request got a token"
            drafts = self._drafts(request, plan.budget - (len(self._running) - index))
            if drafts and self.block_manager.allocate(request, num_new_tokens + len(drafts)):
                plan.drafts[request.request_id] = drafts
                plan.grant(request, num_new_tokens + len(drafts))
            elif self._allocate_or_preempt(request, num_new_tokens, plan):
                plan.grant(request, num_new_tokens)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decode, with speculative decoding on and a request whose drafts can
        be verified exactly (`can_draft`). `budget`: the step's tokens left once every running
        request after this one has its one token; drafts never exceed it, nor run the sequence
        past its max_tokens or max_model_len (a draft there could never be kept). A draft that
        would need a block nobody has free is not proposed: drafts never preempt anyone."""
        spec = self.config.speculative
        if spec is None or not _is_decode(request):
            return []
        if not can_draft(request.sampling_params, spec.method):
            return []
        room = min(spec.num_speculative_tokens, budget - 1, self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        if room < 1:
            return []
        if spec.method == "mtp":  # slots only: the runner's MTP layers fill them in (`worker.mtp_drafter`)
            return [request.output_token_ids[-1]] * room
        return self._ngram_proposer(request, request.num_tokens).propose(room)

    def _ngram_proposer(self, request: Request, upto: int) -> NgramProposer:
        """`request`'s prompt-lookup state, having read its first `upto` tokens (made on first use).
        `update` feeds it each step's tokens as their KV is computed, a prompt chunk by chunk, so
        a step's share of the work follows the tokens it runs, never the context's length."""
        proposer = request.ngram_proposer
        if proposer is None:
            spec = self.config.speculative
            proposer = request.ngram_proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if upto > proposer.num_tokens:
            proposer.extend(request.token_ids_between(proposer.num_tokens, upto))
        return proposer

    def _drafts_ngram(self, request: Request) -> bool:
        """Whether `request` drafts by prompt lookup, so `update` keeps its proposer reading."""
        spec = self.config.speculative
        return spec is not None and spec.method == "ngram" and can_draft(request.sampling_params, spec.method)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Admit queued requests from the head until the budget, seats or blocks run out, or a
        prompt is split (only the newest running request may be mid-prefill).

        A request starts after its cached prefix, whose blocks it shares. When its prefix goes on
        into blocks that this step computes for another request, it waits for the next step, which
        finds them cached: a burst of requests sharing a long system prompt computes it once, not
        once per request admitted alongside the first (the step is one step later for them).
        """
        self._waiting.refresh()
        computing = self._blocks_being_computed(plan) if self._waiting else set()
        while self._waiting:
            request = self._waiting.head()
            if request.needs_remote_kv:  # takes blocks, but neither a seat nor the step's budget
                if not self._start_kv_load(request, plan):
                    break
                continue
            if plan.budget <= 0 or plan.split_prefill or len(self._running) >= self.config.max_num_seqs:
                break
            cached_blocks = self.block_manager.lookup(request)
            if computing and self._next_block_in(request, len(cached_blocks), computing):
                break
            num_cached = len(cached_blocks) * self.config.block_size
            num_new_tokens = self._num_tokens_to_grant(request, plan, num_cached)
            if num_new_tokens == 0:
                break  # the TBT target leaves no room
            if num_cached + num_new_tokens < request.num_tokens and not self.config.enable_chunked_prefill:
                break
            if not self.block_manager.allocate(request, num_new_tokens, cached_blocks):
                break
            self._waiting.pop()
            request.num_computed_tokens = num_cached
            if cached_blocks and self.block_manager.has_state:
                plan.state_loads[request.request_id] = self.block_manager.saved_state(request, len(cached_blocks))
            if self.config.enable_prefix_caching:
                plan.prefix_cache_queries += request.num_tokens
                plan.prefix_cache_hits += num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self._clock()
            if not request.announced:
                request.announced = True
                prompt, outputs = tuple(request.prompt_token_ids), tuple(request.output_token_ids)
                plan.new_requests.append(NewRequest(request.request_id, request.sampling_params, prompt, outputs))
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            plan.grant(request, num_new_tokens)
            computing.update(self._filled_block_hashes(request, num_cached, num_new_tokens))

    def _start_kv_load(self, request: Request, plan: _StepPlan) -> bool:
        """Admit the queue's head to wait for its prompt's KV from another instance up to its
        mark (`_prompt_mark`; the rest, its last token's included, it computes for its logits):
        it takes its cached prefix and fresh blocks for the rest through `allocate` like any
        admission (with several groups `allocate_load`, which skips window blocks dead at the
        mark). False when too few blocks are free: it waits at the head, as any request would."""
        mark = self._prompt_mark(request)
        cached = self.block_manager.lookup(request)
        num_cached = len(cached) * self.config.block_size
        if isinstance(self.block_manager, GroupedBlockManager):
            group_ids = self.block_manager.allocate_load(request, mark, cached)
            if group_ids is None:
                return False
            loaded_blocks: list[int] = []
        elif self.block_manager.allocate(request, mark - num_cached, cached):
            group_ids, loaded_blocks = (), request.block_ids[len(cached) :]
        else:
            return False
        self._waiting.pop()
        request.needs_remote_kv = False
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._loading[request.request_id] = request
        state_slot = -1
        if self.block_manager.has_state and mark > num_cached:
            state_slot = self.block_manager.reserve_state_load(request, mark // self.config.block_size)
        plan.kv_loads.append(KvLoad(request.request_id, loaded_blocks, len(cached), state_slot, group_ids))
        return True

    def finish_kv_load(self, request_id: str, loaded: bool) -> bool:
        """A load that a plan's `kv_loads` asked for has ended: the request goes back to the
        queue's head. Loaded: its blocks join the prefix cache first, so its admission takes them
        as a cached prefix and computes only the rest of its prompt. Not loaded: it recomputes its
        prompt. False when the request no longer waits for it (it finished meanwhile)."""
        request = self._loading.get(request_id)
        if request is None:
            return False
        if not loaded:
            self._give_up_kv_load(request)
            return True
        num_cached = request.num_computed_tokens
        request.num_computed_tokens = self._prompt_mark(request)
        self.block_manager.cache_full_blocks(request, num_cached)
        self._give_up_kv_load(request)  # its blocks stay findable: admission takes them back
        return True

    def _give_up_kv_load(self, request: Request) -> None:
        """Back to the queue's head holding no block, as every queued request: the blocks a
        transfer may still write stay pinned by the load until it ends, and loaded ones, cached,
        are found again on admission. (A queued request holding blocks while it waits for more
        would deadlock with another doing the same, nothing running to free any.)"""
        del self._loading[request.request_id]
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._waiting.requeue(request)

    def _filled_block_hashes(self, request: Request, start: int, num_tokens: int) -> list[BlockHash]:
        """With prefix caching, the hashes of the blocks that computing `num_tokens` tokens from
        position `start` fills."""
        if not self.config.enable_prefix_caching:
            return []
        block_size = self.config.block_size
        return block_hashes(request, block_size, (start + num_tokens) // block_size)[start // block_size :]

    def _blocks_being_computed(self, plan: _StepPlan) -> set[BlockHash]:
        """The blocks the prefill chunks granted so far fill in this step (decodes fill output
        blocks, which a queued prompt hardly ever shares)."""
        return {
            block_hash
            for request, num_tokens in plan.grants.values()
            if not _is_decode(request)
            for block_hash in self._filled_block_hashes(request, request.num_computed_tokens, num_tokens)
        }

    def _next_block_in(self, request: Request, num_cached_blocks: int, hashes: set[BlockHash]) -> bool:
        """Whether the block after `request`'s cached prefix (one it may take from the cache, so
        not its last token's) is among `hashes`."""
        block_size = self.config.block_size
        prefix = block_hashes(request, block_size, (request.num_tokens - 1) // block_size)
        return num_cached_blocks < len(prefix) and prefix[num_cached_blocks] in hashes

    def _num_tokens_to_grant(self, request: Request, plan: _StepPlan, num_computed: int | None = None) -> int:
        """All the tokens `request` has left to feed after `num_computed` (default: its
        `num_computed_tokens`), as far as the budget allows and, for a prefill chunk in a step
        carrying decodes under slo, as far as the TBT target allows."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        most = min(request.num_tokens - num_computed, plan.budget)
        if self._saves_states and self.config.enable_chunked_prefill:  # a chunk ends where a state is saved
            most = min(most, self._next_state_save(request, num_computed) - num_computed)
        sizer, load = self._chunk_sizer, plan.load
        if sizer is None or load is None or not load.num_decodes or not sizer.model.ready or _is_decode(request):
            return most
        return sizer.chunk_tokens(load.shape, num_computed, most, load.num_prefill_tokens, load.tightest_tbt_s)

    @property
    def _saves_states(self) -> bool:
        """Whether steps save states for prefix caching (a model with state layers, slots for them)."""
        return self.block_manager.saved_states.num_slots > 0

    def _state_marks(self, request: Request) -> tuple[int, int]:
        """(every how many positions `request`'s state is saved, the prompt's mark: its last
        position where a hit may resume (`hit_alignment`) before its last token, where a repeat
        of the prompt or a later turn resumes). With several groups the interval is rounded up
        to that alignment."""
        step = self.block_manager.hit_alignment
        interval = -(-self.config.state_save_interval * self.config.block_size // step) * step
        return interval, self._prompt_mark(request)

    def _prompt_mark(self, request: Request) -> int:
        """The prompt's last position where a hit may resume (`hit_alignment`) before its last
        token: where its state is saved, and what a transfer moves (its blocks, that state)."""
        step = self.block_manager.hit_alignment
        return (request.num_prompt_tokens - 1) // step * step

    def _next_state_save(self, request: Request, num_computed: int) -> int:
        """The first position past `num_computed` where `request`'s state is saved."""
        interval, prompt_mark = self._state_marks(request)
        next_interval = (num_computed // interval + 1) * interval
        return prompt_mark if num_computed < prompt_mark < next_interval else next_interval

    def _is_state_save(self, request: Request, position: int) -> bool:
        interval, prompt_mark = self._state_marks(request)
        return position > 0 and (position % interval == 0 or position == prompt_mark)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: _StepPlan) -> bool:
        """Get `request` the blocks for its next tokens, preempting the newest running requests
        until they fit; False if `request` itself had to be preempted. Victims are never granted
        yet: they are newer than `request`, and grants go in admission order."""
        while not self.block_manager.allocate(request, num_new_tokens):
            victim = self._running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Drop a running request's KV and requeue it (fcfs: at the head), to recompute on
        readmission."""
        plan.preempted_ids.append(request.request_id)
        self._requeue_for_recompute(request)

    def _requeue_for_recompute(self, request: Request) -> None:
        self._running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._waiting.requeue(request)

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        """Turn the final grants into the runner's view (after all preemptions, so no stale tables)."""
        scheduled = []
        for request, num_new_tokens in plan.grants.values():
            drafts = plan.drafts.get(request.request_id, [])
            start = request.num_computed_tokens
            stop = start + num_new_tokens - len(drafts)
            save = None
            if self._saves_states and not drafts and self._is_state_save(request, stop):
                save = self.block_manager.save_state(request, stop)
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids_between(start, stop) + drafts,
                    start_position=start,
                    block_ids=list(request.block_ids),
                    sample=stop == request.num_tokens,
                    num_draft_tokens=len(drafts),
                    load_state=plan.state_loads.get(request.request_id, -1),
                    save_state=-1 if save is None else save,
                    group_tables=self.block_manager.group_tables(request),
                )
            )
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - plan.budget,
            preempted_request_ids=plan.preempted_ids,
            new_requests=plan.new_requests,
            finished_request_ids=finished_ids,
            prefix_cache_queries=plan.prefix_cache_queries,
            prefix_cache_hits=plan.prefix_cache_hits,
            kv_loads=plan.kv_loads,
        )

    # ----- results -----

    def _check_stop(self, request: Request) -> tuple[str, int | None] | None:
        """(finish_reason, stop_reason) if the token just appended ends the request, else None.

        Stop tokens are checked before length, so an EOS sampled as the last allowed token reports
        "stop": the model did end there. EOS and stop_token_ids count only from `min_tokens` on.
        """
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return "stop", None
            if token_id in params.stop_token_ids:
                return "stop", token_id
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return "length", None
        if request.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Move a live request to its terminal status, free its blocks and forget it."""
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self._loading[request.request_id]  # the load's own pins keep its blocks until it ends
        else:
            self._waiting.remove(request)
        if request.kv_hold_id is not None and reason != "abort":
            held, state_slot = self.block_manager.hold_prompt(request, self._prompt_mark(request))
            self.kv_holds.append((request.kv_hold_id, held, state_slot))
        self.block_manager.free(request)
        request.status = STATUS_BY_FINISH_REASON[reason]
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self._requests[request.request_id]
        self._finished_ids.append(request.request_id)
