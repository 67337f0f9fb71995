"""From sampled tokens to what clients read: text, stop strings, logprobs and latency stats.

The output processor owns every request's output state while it runs. The scheduler decides when
a request ends by its tokens (EOS, stop token ids, length); stop strings are only visible in
text, so the processor finds them and returns those requests for the engine to finish, which
frees their KV blocks in the same step.

A request with n > 1 fans out into n sequences (`<id>#<i>`) that the scheduler runs as
independent requests; the processor gathers them back into one `RequestOutput`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from moeserve.config import SLOConfig
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from moeserve.engine.stats import IterationStats, RequestMetrics
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request
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
    requests: list[Request] = field(default_factory=list)
    """The scheduler's requests of the samples; the scheduler stamps their first admission."""
    first_token_time: float | None = None

    @property
    def first_scheduled_time(self) -> float | None:
        times = [r.first_scheduled_time for r in self.requests if r.first_scheduled_time is not None]
        return min(times) if times else None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())

    def output(self, metrics: RequestMetrics | None = None) -> RequestOutput:
        completions = sorted((s.completion() for s in self.sequences.values()), key=lambda c: c.index)
        prompt_ids = list(self.prompt_token_ids)
        return RequestOutput(self.request_id, self.prompt, prompt_ids, completions, self.finished, metrics)

    def metrics(self, now: float, finish_reason: str, slo: SLOConfig) -> RequestMetrics:
        """This request's latencies, judged against `slo`."""
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
            ttft_met=ttft is not None and ttft <= slo.ttft_s,
            tbt_met=max_tbt is None or max_tbt <= slo.tbt_s,
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

    def add_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, arrival: float, requests: Sequence[Request]
    ) -> None:
        """Track client request `request_id`, run by the scheduler as `requests` (its n samples)."""
        parent = _Parent(request_id, prompt, list(requests[0].prompt_token_ids), arrival, requests=list(requests))
        for index, request in enumerate(requests):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens
            )
            parent.sequences[request.request_id] = _Sequence(
                index=index,
                detokenizer=detokenizer,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            self._parent_of[request.request_id] = request_id
        self._parents[request_id] = parent

    def abort_request(self, request_id: str, now: float) -> tuple[list[str], RequestMetrics] | None:
        """Forget a client request: (its scheduler request ids, its metrics), or None if unknown."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        for child_id in parent.sequences:
            self._parent_of.pop(child_id, None)
        return list(parent.sequences), parent.metrics(now, "abort", self.slo)

    def process(
        self, sampled: Mapping[str, SampledToken], finished: Sequence[Request], now: float, stats: IterationStats
    ) -> ProcessedStep:
        """Append a step's tokens (sampled at `now`) to their sequences and count them in `stats`.

        `finished` are the requests the scheduler ended in this step; a request whose text
        matched a stop string is returned in `stopped` unless the scheduler ended it already.
        """
        finished_by_id = {r.request_id: r for r in finished}
        step = ProcessedStep([])
        touched: dict[str, None] = {}
        for child_id, token in sampled.items():
            parent_id = self._parent_of[child_id]
            touched[parent_id] = None
            stop = self._append(self._parents[parent_id], child_id, token, now, stats)
            seq = self._parents[parent_id].sequences[child_id]
            request = finished_by_id.get(child_id)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
                if request is None:
                    step.stopped[child_id] = stop
            elif request is not None:
                seq.finish_reason, seq.stop_reason = request.finish_reason, request.stop_reason
        step.outputs = [self._output(parent_id, now, stats) for parent_id in touched]
        return step

    def _append(
        self, parent: _Parent, child_id: str, token: SampledToken, now: float, stats: IterationStats
    ) -> str | None:
        """Count the token in the latencies, then add it to its sequence; a matched stop string."""
        seq = parent.sequences[child_id]
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
        first = min(parent.sequences.values(), key=lambda s: s.index)
        metrics = parent.metrics(now, first.finish_reason, self.slo)
        stats.finished.append(metrics)
        del self._parents[parent_id]
        for child_id in parent.sequences:
            self._parent_of.pop(child_id, None)
        return parent.output(metrics)
