"""The engine: requests in, tokens out, one scheduler step at a time.

    step():  scheduler.schedule() -> runner.execute(...) -> scheduler.update(...)
             -> detokenize, match stop strings -> RequestOutputs

A request with n > 1 fans out into n sequences (`<id>#<i>`) scheduled independently; its
output gathers them. Bad input raises ValueError before anything is queued.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from moeserve.config import EngineConfig, SLOConfig, parse_dtype
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.executor import create_executor
from moeserve.worker.kv_cache import num_blocks_for
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from moeserve.worker.runner import SampledToken
from moeserve.engine.stats import IterationStats, RequestMetrics, StatLogger
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.models import model_config
from moeserve.models.checkpoint import read_json
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig

logger = logging.getLogger(__name__)

ROUTING_INTERVAL_S = 1.0  # expert load is reported to the stat loggers about this often


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
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), completions, self.finished, metrics)

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


def generation_eos_ids(folder: Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (often a list) and config.json, deduplicated."""
    path = folder / "generation_config.json"
    extra = read_json(path).get("eos_token_id") if path.exists() else None
    extra = [] if extra is None else (extra if isinstance(extra, list) else [extra])
    return tuple(dict.fromkeys([*config_eos, *extra]))


class LLMEngine:
    """Stat loggers get an `IterationStats` after every step and every abort (engine thread)."""

    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLogger] = ()) -> None:
        self.config = config
        self.stat_loggers = list(stat_loggers)
        folder = Path(config.model)
        started = time.monotonic()
        torch.manual_seed(config.seed)
        self.model_config = model_config(folder)
        self.dtype = parse_dtype(config.dtype) or self.model_config.checkpoint_dtype
        self.tokenizer = load_tokenizer(folder)
        self.eos_token_ids = generation_eos_ids(folder, self.model_config.eos_token_ids)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {self.model_config.max_position_embeddings}")
        cache, parallel = config.cache, config.parallel
        num_blocks = num_blocks_for(self.model_config, cache, self.dtype, config.max_num_seqs * self.max_model_len, parallel.tp)
        self.scheduler = DataParallelScheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                block_size=cache.block_size,
                num_kv_blocks=num_blocks,
                max_waiting=config.max_waiting,
                policy=config.scheduling_policy,
                slo_ttft_s=config.slo.ttft_s,
                slo_tbt_s=config.slo.tbt_s,
            ),
            num_groups=parallel.num_dp_groups,
        )
        self.executor = create_executor(config, self.model_config, self.dtype, num_blocks, self.eos_token_ids)
        self._parents: dict[str, _Parent] = {}
        self._parent_of: dict[str, str] = {}
        self._ids = itertools.count()
        self._routing_asked = 0.0
        logger.info("engine ready in %.1f s (max_model_len %d)", time.monotonic() - started, self.max_model_len)

    def shutdown(self) -> None:
        """Stop the executor's processes, if any; the engine cannot step afterwards."""
        self.executor.shutdown()

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """See `Executor.add_failure_listener`: a lost rank, reported from another thread."""
        self.executor.add_failure_listener(listener)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        """A text prompt, `{"prompt_token_ids": [...]}` or a list of ids -> (text, ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"a prompt is a string, a list of token ids or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Reject what the model cannot run; returns params with max_tokens fitted to the context."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of the vocabulary [0, {vocab})")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's maximum context length is "
                f"{self.max_model_len}, which leaves no room for a generated token"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

    def add_request(self, prompt: str | dict | list[int], params: SamplingParams, request_id: str | None = None, arrival_time: float | None = None) -> str:
        return self.add_requests([(prompt, params)], [request_id], arrival_time)[0]

    def add_requests(
        self,
        batch: list[tuple[str | dict | list[int], SamplingParams]],
        request_ids: list[str | None] | None = None,
        arrival_time: float | None = None,
    ) -> list[str]:
        """Tokenize and validate every (prompt, params) first, then queue them: a bad prompt
        anywhere raises ValueError with nothing of the batch queued."""
        prepared = []
        for prompt, params in batch:
            text, prompt_token_ids = self.tokenize(prompt)
            prepared.append((text, prompt_token_ids, self.validate(prompt_token_ids, params)))
        ids = request_ids or [None] * len(batch)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return [self._enqueue(text, token_ids, params, rid, arrival) for (text, token_ids, params), rid in zip(prepared, ids)]

    def _enqueue(self, text: str | None, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None, arrival: float) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        parent = _Parent(request_id, text, prompt_token_ids, arrival)
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 or params.seed is None else replace(params, seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, list(prompt_token_ids), child_params, self.eos_token_ids, arrival))
            parent.sequences[child_id] = _Sequence(
                index=i,
                detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output, params.skip_special_tokens),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
        parent.requests = children
        self._parents[request_id] = parent
        for child in children:
            self._parent_of[child.request_id] = request_id
        try:
            for child in children:
                self.scheduler.add_request(child)
        except Exception:  # e.g. QueueFullError on the 2nd of n samples: take back the 1st too
            self.abort_request(request_id)
            raise
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV blocks now; unknown or finished ids are ignored."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for child_id in parent.sequences:
            self.scheduler.abort_request(child_id)
            self._parent_of.pop(child_id, None)
        self.executor.release(list(parent.sequences))
        self._publish(IterationStats(finished=[parent.metrics(time.monotonic(), "abort", self.config.slo)]))

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs of every request that progressed (cumulative text and tokens)."""
        plan = self.scheduler.schedule()
        requests = {s.request_id: self.scheduler.get_request(s.request_id) for s in plan.scheduled}
        started = time.monotonic()
        sampled = self.executor.execute(plan.groups, requests)
        if not plan.is_empty and self.config.min_step_time_s > 0:
            time.sleep(max(0.0, started + self.config.min_step_time_s - time.monotonic()))
        now = time.monotonic()
        if not plan.is_empty:
            self.scheduler.observe_step(plan, now - started)
        finished = {r.request_id: r for r in self.scheduler.update(plan, {rid: t.token_id for rid, t in sampled.items()})}
        stats = IterationStats(step_duration_s=now - started, num_preemptions=len(plan.preempted_request_ids))
        touched: dict[str, None] = {}
        for child_id, token in sampled.items():
            touched[self._record(child_id, token, finished.get(child_id), now, stats)] = None
        outputs = [self._emit(parent_id, now, stats) for parent_id in touched]
        self._publish(stats)
        return outputs

    def _publish(self, stats: IterationStats) -> None:
        """Fill the gauges and hand the stats to every logger; a failing logger never stops serving."""
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_blocks_used = self.scheduler.num_used_blocks
        stats.kv_blocks_total = self.scheduler.num_kv_blocks
        now = time.monotonic()
        if stats.step_duration_s is not None and now - self._routing_asked >= ROUTING_INTERVAL_S:
            self._routing_asked = now
            stats.routed_tokens = self.executor.take_routed_tokens()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:
                logger.exception("stat logger %r failed; the engine keeps serving", stat_logger)

    def _record(self, child_id: str, token: SampledToken, finished: Request | None, now: float, stats: IterationStats) -> str:
        parent_id = self._parent_of[child_id]
        parent = self._parents[parent_id]
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
        stop = seq.detokenizer.append(token.token_id)
        if seq.logprobs is not None and token.logprob is not None:
            entry = {token.token_id: Logprob(token.logprob)}
            for rank, (alt_id, alt_lp) in enumerate(token.top_logprobs, start=1):
                entry.setdefault(alt_id, Logprob(alt_lp, rank))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += token.logprob
        if stop is not None:
            if finished is None:
                self.scheduler.finish_request(child_id, "stop", stop)
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif finished is not None:
            seq.finish_reason, seq.stop_reason = finished.finish_reason, finished.stop_reason
        if seq.finish_reason is not None:
            self.executor.release([child_id])
        return parent_id

    def _emit(self, parent_id: str, now: float, stats: IterationStats) -> RequestOutput:
        parent = self._parents[parent_id]
        if not parent.finished:
            return parent.output()
        first = min(parent.sequences.values(), key=lambda s: s.index)
        metrics = parent.metrics(now, first.finish_reason, self.config.slo)
        stats.finished.append(metrics)
        del self._parents[parent_id]
        for child_id in parent.sequences:
            self._parent_of.pop(child_id, None)
        return parent.output(metrics)
