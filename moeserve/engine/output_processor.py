"""From sampled tokens to what clients read: text, stop strings, logprobs and latency stats.

The output processor owns every request's output state while it runs. The scheduler decides when
a request ends by its tokens (EOS, stop token ids, length); stop strings are only visible in
text, so the processor finds them and returns those requests for the engine to finish, which
frees their KV blocks in the same step.

A request with n > 1 fans out into n sequences (`<id>#<i>`) that the scheduler runs as
independent requests; the processor gathers them back into one `RequestOutput`.

Behind the server the core steps in another process and may run a sequence once more before it
hears that a stop string or an abort ended it: tokens of sequences that already ended here, or of
requests no longer known, are dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from moeserve.config import SLOConfig
from moeserve.engine.core import CoreStep
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from moeserve.engine.stats import IterationStats, RequestMetrics
from moeserve.sampling_params import SamplingParams
from moeserve.slo import DEFAULT_CLASS, RequestSLO
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken


@dataclass
class _Sequence:
    """Output state of one generated sequence."""

    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None
    max_gap_s: float | None = None  # longest time between two consecutive tokens so far

    def append(self, token: SampledToken) -> str | None:
        """Add a token to the text and logprobs; the stop string it completed, if any."""
        stop = self.detokenizer.append(token.token_id)
        if self.logprobs is not None and token.logprob is not None:
            entry = {token.token_id: Logprob(token.logprob)}
            for rank, (alt_id, alt_lp) in enumerate(token.top_logprobs, start=1):
                entry.setdefault(alt_id, Logprob(alt_lp, rank))
            self.logprobs.append(entry)
            self.cumulative_logprob += token.logprob
        return stop

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.text,
            token_ids=list(self.detokenizer.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    sequences: dict[str, _Sequence] = field(default_factory=dict)
    """In index order (added so)."""
    first_scheduled_time: float | None = None
    """When the first of its samples was admitted, as the core reports it."""
    first_token_time: float | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Filled chunk by chunk before the first token; the first prompt token has no logprob."""
    unfinished: int = 0
    """Samples without a finish reason yet (`finish` counts them down)."""
    slo: RequestSLO | None = None
    """Its own targets; None: the server's."""
    best_effort_ttft_s: float | None = None
    """Set when SLO admission took it as best effort: the TTFT it predicted (over the target)."""

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Append the positions of a chunk not known yet. With n > 1 every sample computes them,
        so that whichever samples first has them all; each sample reports its positions in
        order, so the known ones always run from the start to the furthest sample's."""
        if self.prompt_logprobs is None:
            return
        known = len(self.prompt_logprobs)
        for offset in range(max(known - chunk.start, 0), len(chunk.logprobs)):
            logprob, rank, top = chunk.logprobs[offset], chunk.ranks[offset], chunk.top[offset]
            token_id = self.prompt_token_ids[chunk.start + offset]
            entry = {token_id: Logprob(logprob, rank)}
            for alt_rank, (alt_id, alt_logprob) in enumerate(top, start=1):
                entry.setdefault(alt_id, Logprob(alt_logprob, alt_rank))
            self.prompt_logprobs.append(entry)

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def finish(self, seq: _Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.unfinished -= 1

    def output(self, metrics: RequestMetrics | None = None) -> RequestOutput:
        completions = [s.completion() for s in self.sequences.values()]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.unfinished == 0,
            metrics,
            self.prompt_logprobs,  # whole by the first output and never changed after: shared, not copied
        )

    def metrics(self, now: float, finish_reason: str, slo: SLOConfig) -> RequestMetrics:
        """This request's latencies, judged against its own targets, else `slo`'s."""
        own = self.slo if self.slo is not None else RequestSLO(slo.ttft_s, slo.tbt_s, DEFAULT_CLASS)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        gaps = [s.max_gap_s for s in self.sequences.values() if s.max_gap_s is not None]
        max_tbt = max(gaps) if gaps else None
        return RequestMetrics(
            finish_reason=finish_reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=sum(len(s.detokenizer.token_ids) for s in self.sequences.values()),
            queue_time_s=None if (scheduled := self.first_scheduled_time) is None else scheduled - self.arrival_time,
            ttft_s=ttft,
            e2e_s=now - self.arrival_time,
            max_tbt_s=max_tbt,
            ttft_met=ttft is not None and ttft <= own.ttft_s,
            tbt_met=max_tbt is None or max_tbt <= own.tbt_s,
            slo_class=own.label,
            best_effort_ttft_s=self.best_effort_ttft_s,
        )


@dataclass
class ProcessedStep:
    """One step's outputs, and the requests a stop string ended, which the scheduler must finish."""

    outputs: list[RequestOutput]
    """One per client request that got a token, cumulative; finished ones carry their metrics."""
    stopped: dict[str, str] = field(default_factory=dict)
    """Scheduler request id -> the stop string its text matched."""


class OutputProcessor:
    """Output state of every unfinished client request, and the stats its tokens make."""

    def __init__(self, tokenizer: object, slo: SLOConfig) -> None:
        self.tokenizer = tokenizer
        self.slo = slo
        self._parents: dict[str, _Parent] = {}
        self._parent_of: dict[str, str] = {}  # scheduler request id -> client request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def mark_best_effort(self, request_id: str, predicted_ttft_s: float) -> None:
        """See `EngineFrontend.mark_best_effort`; an id already gone is ignored."""
        parent = self._parents.get(request_id)
        if parent is not None:
            parent.best_effort_ttft_s = predicted_ttft_s

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        sequence_ids: Sequence[str],
    ) -> None:
        """Track client request `request_id`, run by the core as `sequence_ids` (its n samples)."""
        parent = _Parent(request_id, prompt, list(prompt_token_ids), arrival, slo=params.slo)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, sequence_id in enumerate(sequence_ids):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
            parent.sequences[sequence_id] = _Sequence(
                index=index,
                detokenizer=detokenizer,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            self._parent_of[sequence_id] = request_id
        parent.unfinished = len(parent.sequences)
        self._parents[request_id] = parent

    def abort_request(self, request_id: str, now: float) -> tuple[list[str], RequestMetrics] | None:
        """Forget a client request: (its scheduler request ids, its metrics), or None if unknown."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child_id in parent.sequences:
            self._parent_of.pop(child_id, None)
        return list(parent.sequences), parent.metrics(now, "abort", self.slo)

    def process(self, step: CoreStep, stats: IterationStats) -> ProcessedStep:
        """Append a core step's tokens to their sequences and count them in `stats`.

        A sequence the core ended (EOS, length) takes its reason; one whose text matched a stop
        string is returned in `stopped`, for the core to finish, unless the core ended it already.
        """
        now = step.time
        for sequence_id, admitted in step.first_scheduled.items():
            parent = self._parents.get(self._parent_of.get(sequence_id, ""))
            if parent is not None and (parent.first_scheduled_time is None or admitted < parent.first_scheduled_time):
                parent.first_scheduled_time = admitted
        for sequence_id, chunk in step.prompt_logprobs.items():  # before tokens: the first output has them all
            parent = self._parents.get(self._parent_of.get(sequence_id, ""))
            if parent is not None:
                parent.add_prompt_logprobs(chunk)
        ended = {f.request_id: f for f in step.finished}
        processed = ProcessedStep([])
        touched: dict[str, None] = {}
        for sequence_id, token in step.sampled.items():
            parent_id = self._parent_of.get(sequence_id)
            if parent_id is None:
                continue  # aborted, or its request finished while this step ran
            parent = self._parents[parent_id]
            seq = parent.sequences[sequence_id]
            if seq.finish_reason is not None:
                continue  # a stop string ended it; the core had not heard yet
            touched[parent_id] = None
            stop = None
            for piece in _burst(token):
                stop = self._append(parent, seq, piece, now, stats)
                if stop is not None:
                    break
            end = ended.get(sequence_id)
            if stop is not None:
                parent.finish(seq, "stop", stop)
                if end is None:
                    processed.stopped[sequence_id] = stop
            elif end is not None:
                parent.finish(seq, end.finish_reason, end.stop_reason)
        for sequence_id in ended.keys() - step.sampled.keys():  # ended by the core without a token
            parent_id = self._parent_of.get(sequence_id)
            if parent_id is not None and self._parents[parent_id].sequences[sequence_id].finish_reason is None:
                parent = self._parents[parent_id]
                parent.finish(
                    parent.sequences[sequence_id], ended[sequence_id].finish_reason, ended[sequence_id].stop_reason
                )
                touched[parent_id] = None
        processed.outputs = [self._output(parent_id, now, stats) for parent_id in touched]
        return processed

    def _append(
        self, parent: _Parent, seq: _Sequence, token: SampledToken, now: float, stats: IterationStats
    ) -> str | None:
        """Count the token in the latencies, then add it to its sequence; a matched stop string.

        Several tokens of one step (accepted drafts) reach the client together: the first one's
        gap is the time since the previous step's, the others' is 0, as a client timing tokens
        on arrival sees them."""
        stats.num_generation_tokens += 1
        if parent.first_token_time is None:
            parent.first_token_time = now
            stats.ttfts_s.append(now - parent.arrival_time)
            stats.num_prompt_tokens += len(parent.prompt_token_ids)
        if seq.last_token_time is not None:
            gap = now - seq.last_token_time
            stats.tbts_s.append(gap)
            seq.max_gap_s = gap if seq.max_gap_s is None else max(seq.max_gap_s, gap)
        seq.last_token_time = now
        return seq.append(token)

    def _output(self, parent_id: str, now: float, stats: IterationStats) -> RequestOutput:
        parent = self._parents[parent_id]
        if not parent.finished:
            return parent.output()
        first = next(iter(parent.sequences.values()))
        metrics = parent.metrics(now, first.finish_reason, self.slo)
        stats.finished.append(metrics)
        del self._parents[parent_id]
        for child_id in parent.sequences:
            self._parent_of.pop(child_id, None)
        return parent.output(metrics)


def _burst(token: SampledToken) -> list[SampledToken]:
    """The tokens a step added to one sequence, one `SampledToken` each: accepted drafts (with
    their logprobs, where the request asked), then the sampled one."""
    if not token.accepted_draft_ids:
        return [token]
    logprobs = token.accepted_draft_logprobs or [(None, ())] * len(token.accepted_draft_ids)
    drafts = [SampledToken(draft, lp, top) for draft, (lp, top) in zip(token.accepted_draft_ids, logprobs)]
    return drafts + [dataclasses.replace(token, accepted_draft_ids=(), accepted_draft_logprobs=())]
