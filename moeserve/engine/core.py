"""The engine core: the scheduler and the executor, stepping on token ids; nothing about text.

    step():  scheduler.schedule() -> [grammar bitmask fill starts] -> executor.execute(plan, pending bitmask)
             -> scheduler.update(plan, tokens, time) -> [grammars advance]
             -> CoreStep (new tokens, sequences the scheduler ended, first admissions, gauges)

It runs beside the frontend in `LLMEngine` (offline, one thread) or alone in the engine core
process behind the server (`core_process.py`), where its inputs and outputs cross a socket once
per step. It never sees a client request, only sequences: a request with n > 1 arrives as n
`CoreRequest`s, added together or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeserve.config import EngineConfig, ModelConfig
from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.engine.step_profile import profile_step_times
from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.executor import HealReport, RanksLostError, RejoinReport, create_executor
from moeserve.kv_transfer.coordinator import KvCoordinator
from moeserve.models.decoder import cache_specs
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, QueueFullError, Request, SchedulerConfig, StepPlan
from moeserve.scheduler.block_groups import GroupBlocks, group_block_counts
from moeserve.spec_decode.stats import SpecDecodeStats
from moeserve.structured import GrammarCompiler, StructuredOutputManager
from moeserve.worker.kv_cache import num_blocks_for
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken

logger = logging.getLogger(__name__)

ROUTING_INTERVAL_S = 1.0  # expert load is taken from the executor about this often
GRAMMAR_WAIT_S = 0.05  # with only grammars compiling, a step waits this long for one to finish
KV_WAIT_S = 0.02  # with only KV transfers under way, a step waits this long for one to end


@dataclass(frozen=True)
class CoreRequest:
    """One sequence to generate: a whole request, or one sample of a request with n > 1."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    """When the client asked (monotonic clock, which every process on the machine shares)."""


@dataclass(frozen=True)
class FinishedSequence:
    """A sequence the scheduler ended in a step (EOS, a stop token id, or its length)."""

    request_id: str
    finish_reason: str
    stop_reason: int | str | None


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's gauges at one moment."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    ttft_promised: int = 0
    """Requests SLO admission admitted on a prediction of meeting their TTFT target, so far."""
    ttft_promises_kept: int = 0
    """Of those, the ones whose first token did come within the target."""
    state_slots_used: int = 0
    """A model with state layers: the running sequences' state slots (0 for another model)."""
    state_slots_total: int = 0
    saved_states_held: int = 0
    """Prefix caching's saved states a hit can resume from (a model with state layers)."""
    saved_states_total: int = 0
    group_blocks: tuple[GroupBlocks, ...] = ()
    """Each block-table group's blocks held and pool (one `full` group for most models); the
    `kv_blocks_*` above are their sums."""


@dataclass
class CoreStep:
    """What one step did, in sequences: all the frontend needs to make outputs and stats."""

    sampled: dict[str, SampledToken]
    finished: list[FinishedSequence]
    first_scheduled: dict[str, float]
    """Sequences that ran for the first time in this step -> when they were admitted."""
    time: float
    """When the step's tokens existed (monotonic): the clock of TTFT and TBT."""
    step_duration_s: float
    num_preemptions: int
    scheduler: SchedulerStats
    routed_tokens: RoutedTokens | None = None
    """Expert load since the last step that carried one, up to this step: about once a second,
    and at every rebalance (so a report never mixes two expert maps)."""
    rebalances: list[RebalanceReport] = field(default_factory=list)
    """Live expert rebalances that ended with this step (`--enable-eplb`)."""
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted in this step (see `SchedulerOutput.prefix_cache_queries`)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens found in the prefix cache."""
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    """The prompt positions this step computed, per sequence that asked for prompt logprobs."""
    heals: list[HealReport] = field(default_factory=list)
    """Lost ranks healed in this step (`--on-rank-failure heal`): its plan was abandoned, no
    token came of it, and its requests were requeued to recompute."""
    rejoins: list[RejoinReport] = field(default_factory=list)
    """Restarted ranks taken back into the group before this step was planned."""
    spec_decode: SpecDecodeStats | None = None
    """Drafts fed and kept in this step; None when no sequence drafted."""


def state_refusal(config: EngineConfig) -> str | None:
    """Why `config` cannot serve a model whose layers keep a state per sequence (Gated DeltaNet),
    or None. Drafts (n-gram or MTP) are verified with the state after each token kept, on either
    backend's kernels. Disaggregation moves a prompt's state as a saved state of
    prefix caching (`kv_transfer.layout`), so it needs prefix caching on."""
    if config.kv_transfer.enabled and not config.num_saved_states:
        return (
            "prefill/decode disaggregation (kv_transfer) moves Gated DeltaNet states as prefix "
            "caching's saved states: enable prefix caching, with saved states > 0"
        )
    return None


def groups_refusal(config: EngineConfig) -> str | None:
    """Why `config` cannot serve a model whose paged caches form several block-table groups
    (DeepSeek-V4), or None: its runner feeds the model sequence by sequence, drafts included
    (n-gram or its MTP block's; its compressors step back past rejected ones), and two-batch
    overlap in micro-batches of whole sequences. Disaggregation moves what a prefix-cache hit at
    the prompt's mark reads (`kv_transfer.coordinator`), so both roles need prefix caching on."""
    if config.kv_transfer.enabled and not config.cache.enable_prefix_caching:
        return (
            "prefill/decode disaggregation (kv_transfer) of caches in several block-table groups moves "
            "what a prefix-cache hit reads: enable prefix caching"
        )
    return None


def build_scheduler(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int):
    """The data-parallel scheduler for `config`, with as many KV blocks as the cache budget buys
    once every running sequence's state is set aside (see `worker.kv_cache`)."""
    cache, parallel = config.cache, config.parallel
    mtp_layers = model_config.num_mtp_layers if config.mtp_drafts else 0
    specs = cache_specs(model_config, dtype, parallel.tp, mtp_layers)
    grouped = len(specs.groups) > 1
    if grouped:
        refusal = groups_refusal(config)
        if refusal is not None:
            raise ValueError(f"{model_config.architecture}: {refusal}")
    if specs.has_state:
        refusal = state_refusal(config)
        if refusal is not None:
            raise ValueError(f"{model_config.architecture}: {refusal}")
    saved_states = config.num_saved_states if specs.has_state else 0
    num_blocks = num_blocks_for(
        model_config,
        cache,
        dtype,
        config.max_num_seqs,
        max_model_len,
        parallel.tp,
        mtp_layers,
        config.draft_states,
        saved_states,
        config.max_num_batched_tokens,
    )
    block_groups: tuple = ()
    if grouped:
        counts = group_block_counts(
            specs.groups, num_blocks, cache.block_size, config.max_num_seqs, config.max_num_batched_tokens
        )
        block_groups = tuple(zip(specs.groups, counts, strict=True))
    return DataParallelScheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=cache.block_size,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
            has_state=specs.has_state,
            block_groups=block_groups,
            num_saved_states=saved_states,
            max_waiting=config.max_waiting,
            policy=config.scheduling_policy,
            slo_ttft_s=config.slo.ttft_s,
            slo_tbt_s=config.slo.tbt_s,
            slo_admission=config.slo.admission,
            dp_routing=config.dp_routing,
            speculative=config.speculative_config,
        ),
        num_groups=parallel.num_dp_groups,
    )


class EngineCore:
    """The scheduler and executor of one model; single-threaded, like everything that steps."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler = build_scheduler(config, model_config, dtype, max_model_len)
        # The executor sees max_model_len resolved: captured decode steps are shaped for it.
        self.executor = create_executor(
            dataclasses.replace(config, max_model_len=max_model_len),
            model_config,
            dtype,
            self.scheduler.config.num_kv_blocks,
            self.eos_token_ids,
        )
        self._requests: dict[str, Request] = {}  # sequences not yet admitted once, for first_scheduled
        self._routing_asked = float("-inf")  # never: the first step asks, however recent the boot
        self.structured = StructuredOutputManager(
            GrammarCompiler(
                lambda: _load_tokenizer(config.model),
                model_config.vocab_size,
                self.eos_token_ids,
                config.structured_outputs.cache_bytes,
            )
        )
        self._compiling: dict[str, tuple[Request, Future]] = {}
        """Sequences under a grammar still being compiled: held here, out of the scheduler."""
        self._first_scheduled_late: dict[str, float] = {}
        """First admissions of a step lost with a rank, reported with the next step."""
        self.heals: list[HealReport] = []
        """Every heal after lost ranks so far (`--on-rank-failure heal`)."""
        self.rejoins: list[RejoinReport] = []
        """Every return of a restarted rank so far."""
        self.kv: KvCoordinator | None = None
        """Prefill/decode disaggregation (`--role prefill|decode`): KV held for or loaded from peers."""
        if any(group.step_time_model is not None for group in self.scheduler.groups):  # slo policy or admission
            profile_step_times(self.scheduler, self._profile_step, model_config.vocab_size)
        if config.kv_transfer.enabled:
            registrations = self.executor.kv_registrations()
            writers = self.executor.kv_writers() if config.kv_transfer.role == "prefill" else []
            self.kv = KvCoordinator(config.kv_transfer, self.scheduler, registrations, writers)

    def shutdown(self) -> None:
        """Stop the executor's processes, if any; the core cannot step afterwards."""
        self.structured.shutdown()
        if self.kv is not None:
            self.kv.close()
        self.executor.shutdown()

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """See `Executor.add_failure_listener`: a lost rank, reported from another thread."""
        self.executor.add_failure_listener(listener)

    # ---- requests -------------------------------------------------------------------------

    def add_requests(self, requests: Iterable[CoreRequest]) -> float | None:
        """Queue the samples of one request, all or none: a QueueFullError on the second takes
        the first back before it is raised. Returns the predicted TTFT of a request SLO admission
        took as best effort (its target predicted to be missed), else None."""
        added = []
        try:
            for r in requests:
                request = Request(r.request_id, list(r.prompt_token_ids), r.params, self.eos_token_ids, r.arrival_time)
                self._add(request)
                self._requests[r.request_id] = request
                added.append(r.request_id)
        except Exception:
            self.abort_requests(added)
            raise
        predicted = [r.predicted_ttft_s for rid in added if (r := self._requests[rid]).best_effort]
        return max(predicted) if predicted else None

    def _add(self, request: Request) -> None:
        """To the scheduler, or, under a grammar not compiled yet, aside until it is (the queue
        bound counts it as waiting)."""
        spec = request.sampling_params.structured_outputs
        if spec is None:
            self.scheduler.add_request(request)
            return
        if request.request_id in self._compiling:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        future = self.structured.compiler.compile(spec)
        if future.done() and future.exception() is None:
            self.scheduler.add_request(request)
            self.structured.start(request.request_id, future.result())
            return
        max_waiting = self.config.max_waiting
        if max_waiting is not None and self.scheduler.num_waiting + len(self._compiling) >= max_waiting:
            raise QueueFullError(f"waiting queue is full ({max_waiting} requests)")
        self._compiling[request.request_id] = (request, future)

    def _admit_compiled(self) -> list[FinishedSequence]:
        """Hand the sequences whose grammar is ready to the scheduler; those whose grammar or
        admission failed end as "abort" (the grammar was checked when the request came in, so
        that is a bug, logged as one). With nothing else to run, wait a moment for a compile."""
        if self._compiling and not self.scheduler.has_unfinished_requests():
            wait([future for _, future in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        failed = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                compiled = future.result()
                self.scheduler.add_request(request, slo_admission=False)  # accepted long ago: no refusal now
            except Exception as exc:  # noqa: BLE001 - the sequence ends, the engine goes on
                logger.error("could not schedule %s under its grammar: %s", request_id, exc)
                failed.append(FinishedSequence(request_id, "abort", None))
                continue
            self.structured.start(request_id, compiled)
        for finished in failed:
            self._requests.pop(finished.request_id, None)
        return failed

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Drop sequences and free their KV blocks now; unknown or finished ids are ignored."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)
            self._compiling.pop(request_id, None)
            self.scheduler.abort_request(request_id)
        self.structured.remove(request_ids)

    def finish_requests(self, stops: Mapping[str, str]) -> None:
        """End sequences whose text matched a stop string (the frontend sees text; the core does not)."""
        for request_id, stop in stops.items():
            self._requests.pop(request_id, None)
            self.scheduler.finish_request(request_id, "stop", stop)
        self.structured.remove(stops)

    def has_unfinished_requests(self) -> bool:
        busy = self.scheduler.has_unfinished_requests() or bool(self._compiling)
        return busy or (self.kv is not None and self.kv.busy)

    def scheduler_stats(self) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(
            s.num_running,
            s.num_waiting + len(self._compiling),
            s.num_used_blocks,
            s.num_kv_blocks,
            s.admission.predicted_on_time,
            s.admission.on_time,
            *s.num_state_slots,
            *s.num_saved_states,
            s.group_blocks,
        )

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> CoreStep:
        rejoined = self._rejoin()
        failed = self._admit_compiled()
        if self.kv is not None:
            failed += self._settle_kv()
            if not self.scheduler.has_unfinished_requests() and not self._compiling:
                self.kv.wait(KV_WAIT_S)  # only transfers under way: nothing to run
                return self._idle_step(failed, rejoined)
        plan = self.scheduler.schedule()
        if self.kv is not None:
            self._start_kv_loads(plan)
        first_scheduled = {}
        for group in plan.groups:
            for new in group.new_requests:
                request = self._requests.pop(new.request_id, None)
                if request is not None and request.first_scheduled_time is not None:
                    first_scheduled[new.request_id] = request.first_scheduled_time
        if self._first_scheduled_late:
            first_scheduled, self._first_scheduled_late = {**self._first_scheduled_late, **first_scheduled}, {}
        started = time.monotonic()
        report_load = started - self._routing_asked >= ROUTING_INTERVAL_S
        if report_load:  # asked before the step, so the report includes it
            self.executor.ask_routed_tokens()
        # One batched fill for every constrained sequence that samples now, beside the forward.
        pending = self.structured.start_bitmask([s.request_id for s in plan.scheduled if s.sample], _ngram_drafts(plan))
        try:
            sampled = self.executor.execute(plan) if pending is None else self.executor.execute(plan, pending)
        except BaseException as exc:
            if pending is not None:
                pending.settle()  # never leave the filler reading matchers that what follows changes
            if not isinstance(exc, RanksLostError):
                raise
            self._first_scheduled_late = first_scheduled
            return self._heal(exc, failed, started, rejoined)
        bitmask = None if pending is None else pending.get()
        duration_s, group_durations_s = self._padded(plan, time.monotonic() - started)
        time.sleep(max(0.0, started + duration_s - time.monotonic()))  # what the test-only knobs add
        added = {rid: t.token_ids for rid, t in sampled.items()}  # accepted drafts, then the sampled token
        ended = self.scheduler.update(plan, added, duration_s, group_durations_s)
        finished = [FinishedSequence(r.request_id, r.finish_reason, r.stop_reason) for r in ended]
        if bitmask is not None:
            finished += self._advance_grammars(added, bitmask.request_ids, {r.request_id for r in ended})
        self.structured.remove(f.request_id for f in finished)
        if self.kv is not None:  # a hold is known before its request's answer leaves: a push may follow at once
            self.kv.collect_holds()
            if plan.is_empty and self.kv.loading:
                self.kv.wait(KV_WAIT_S)  # only loads under way: nothing to run until one ends
        now = time.monotonic()
        rebalances = self.executor.take_rebalances()
        prompt_logprobs = self.executor.take_prompt_logprobs()
        routed = None
        if report_load or rebalances:
            routed = self.executor.take_routed_tokens()
            if routed is not None:
                self._routing_asked = now
        drafted = {s.request_id: s.num_draft_tokens for s in plan.scheduled if s.num_draft_tokens}
        spec_decode = None
        if drafted:
            kept = {rid: len(t.accepted_draft_ids) for rid, t in sampled.items()}
            spec_decode = SpecDecodeStats.of_step(drafted, kept)
        return CoreStep(
            sampled=sampled,
            finished=failed + finished,
            first_scheduled=first_scheduled,
            time=now,
            step_duration_s=duration_s,
            num_preemptions=len(plan.preempted_request_ids),
            scheduler=self.scheduler_stats(),
            routed_tokens=routed,
            rebalances=rebalances,
            prefix_cache_queries=plan.prefix_cache_queries,
            prefix_cache_hits=plan.prefix_cache_hits,
            prompt_logprobs=prompt_logprobs,
            rejoins=rejoined,
            spec_decode=spec_decode,
        )

    def _start_kv_loads(self, plan: StepPlan) -> None:
        """Start the KV loads of the requests the scheduler admitted to wait for them."""
        assert self.kv is not None
        for group, output in enumerate(plan.groups):
            for order in output.kv_loads:
                self.kv.start_load(order, group, self._requests[order.request_id])

    def _settle_kv(self) -> list[FinishedSequence]:
        """Release and queue what KV transfers have finished with; loads that failed end as "abort"
        (`--kv-load-failure-policy fail`)."""
        assert self.kv is not None
        failed = self.kv.settle()
        for request_id in failed:
            self._requests.pop(request_id, None)
        return [FinishedSequence(request_id, "abort", None) for request_id in failed]

    def _idle_step(self, finished: list[FinishedSequence], rejoined: list[RejoinReport]) -> CoreStep:
        """A turn that ran nothing (transfers under way), reporting what ended meanwhile."""
        return CoreStep(
            sampled={},
            finished=finished,
            first_scheduled={},
            time=time.monotonic(),
            step_duration_s=0.0,
            num_preemptions=0,
            scheduler=self.scheduler_stats(),
            rejoins=rejoined,
        )

    def _padded(self, plan: StepPlan, elapsed_s: float) -> tuple[float, tuple[float, ...] | None]:
        """How long a step of `plan` that computed for `elapsed_s` lasts, with the test-only knobs
        that emulate slower hardware: at least `min_step_time_s`, and the slow rank's extra time
        for its group's share (see `moeserve.straggler`). Also each group's own time when a rank
        is slow (the slow group's the whole step), else None. A served step sleeps the difference;
        the start-up profile only counts it."""
        if plan.is_empty:
            return elapsed_s, None
        duration_s = max(elapsed_s, self.config.min_step_time_s)
        slow = self.config.debug_slow_rank
        if slow is None:
            return duration_s, None
        group = slow.rank // self.config.parallel.tp
        slowed_s = duration_s + slow.delay_s(plan.groups[group].num_batched_tokens)
        return slowed_s, tuple(slowed_s if g == group else duration_s for g in range(len(plan.groups)))

    def _profile_step(self, plan: StepPlan) -> tuple[dict[str, tuple[int, ...]], float, tuple[float, ...] | None]:
        """Run one plan of the start-up profile (`step_profile`), timed as `step` times a served
        one, knobs included, but without sleeping: nobody waits for these tokens."""
        started = time.monotonic()
        sampled = self.executor.execute(plan, profile=True)
        duration_s, group_durations_s = self._padded(plan, time.monotonic() - started)
        return {rid: t.token_ids for rid, t in sampled.items()}, duration_s, group_durations_s

    def _rejoin(self) -> list[RejoinReport]:
        """Restarted ranks back in the group (if any are ready) serve as new groups from this step."""
        report = self.executor.rejoin()
        if report is None:
            return []
        self.scheduler.add_groups(len(report.ranks))
        self.rejoins.append(report)
        return [report]

    def _heal(
        self, lost: RanksLostError, failed: list[FinishedSequence], started: float, rejoined: list[RejoinReport]
    ) -> CoreStep:
        """The step was lost with ranks: the executor heals (or raises, and the engine stops),
        then the requests are requeued to recompute what the step would have computed. Grammar
        matchers advance only with tokens, so they stand where the lost step found them."""
        report = self.executor.heal(lost)
        requeue_started = time.monotonic()
        moved = self.scheduler.heal(report.lost_groups)
        now = time.monotonic()
        report = dataclasses.replace(
            report, requeue_s=now - requeue_started, moved_requests=moved, total_s=now - report.detected_at
        )
        logger.warning("%s", report.describe())
        self.heals.append(report)
        return CoreStep(
            sampled={},
            finished=failed,
            first_scheduled={},
            time=now,
            step_duration_s=now - started,
            num_preemptions=0,
            scheduler=self.scheduler_stats(),
            heals=[report],
            rejoins=rejoined,
        )

    def _advance_grammars(
        self, added: Mapping[str, Sequence[int]], request_ids: Sequence[str], ended: set[str]
    ) -> list[FinishedSequence]:
        """Feed the step's tokens (accepted drafts, then the sampled one) to their matchers. A
        complete grammar ends its sequence as "stop" (usually the scheduler already did, on the
        EOS that completed it; not under ignore_eos); a refused token (the bitmask forbade it,
        e.g. min_tokens masked the only allowed EOS) ends it as "abort" rather than let it run on
        outside its grammar."""
        terminated, refused = self.structured.accept(added, request_ids)
        finished = []
        for request_id, reason in [(r, "stop") for r in terminated] + [(r, "abort") for r in refused]:
            if request_id not in ended and self.scheduler.finish_request(request_id, reason):
                finished.append(FinishedSequence(request_id, reason, None))
        return finished


def _ngram_drafts(plan: StepPlan) -> dict[str, tuple[int, ...]]:
    """The drafts each sequence verifies this step (n-gram ones: the scheduler proposed them).
    MTP's are only slots here, filled on the ranks after the mask, so the scheduler keeps
    sequences under a grammar from drafting with MTP (`can_draft`)."""
    return {
        s.request_id: tuple(s.token_ids[len(s.token_ids) - s.num_draft_tokens :])
        for s in plan.scheduled
        if s.num_draft_tokens and s.sample
    }


def _load_tokenizer(model: str):
    """The served tokenizer, for compiling grammars (loaded on the compile thread, on first use)."""
    from moeserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(Path(model))
