"""The engine: requests in, tokens out, one scheduler step at a time.

    step():  scheduler.schedule() -> executor.execute(plan) -> scheduler.update(plan, tokens, time)
             -> output_processor.process(...) -> RequestOutputs, and stop-string matches finished

A request with n > 1 fans out into n sequences (`<id>#<i>`) scheduled independently; its
output gathers them. Bad input raises ValueError before anything is queued.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from moeserve.config import EngineConfig, parse_dtype
from moeserve.engine.output_processor import OutputProcessor
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.stats import IterationStats, StatLogger
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.executor import create_executor
from moeserve.models import model_config
from moeserve.models.checkpoint import read_json
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig, StepPlan
from moeserve.worker.kv_cache import num_blocks_for
from moeserve.worker.runner import SampledToken

logger = logging.getLogger(__name__)

ROUTING_INTERVAL_S = 1.0  # expert load is reported to the stat loggers about this often


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
        self.model_config = model_config(folder)
        self.dtype = parse_dtype(config.dtype) or self.model_config.checkpoint_dtype
        self.tokenizer = load_tokenizer(folder)
        self.eos_token_ids = generation_eos_ids(folder, self.model_config.eos_token_ids)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{self.model_config.max_position_embeddings}"
            )
        cache, parallel = config.cache, config.parallel
        num_blocks = num_blocks_for(
            self.model_config, cache, self.dtype, config.max_num_seqs * self.max_model_len, parallel.tp
        )
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
        self.output_processor = OutputProcessor(self.tokenizer, config.slo)
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
        raise ValueError(
            f"a prompt is a string, a list of token ids or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

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

    def add_request(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
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
        return [
            self._enqueue(text, token_ids, params, rid, arrival)
            for (text, token_ids, params), rid in zip(prepared, ids)
        ]

    def _enqueue(
        self,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        arrival: float,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 or params.seed is None else replace(params, seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, list(prompt_token_ids), child_params, self.eos_token_ids, arrival))
        self.output_processor.add_request(request_id, text, params, arrival, children)
        try:
            for child in children:
                self.scheduler.add_request(child)
        except Exception:  # e.g. QueueFullError on the 2nd of n samples: take back the 1st too
            self.abort_request(request_id)
            raise
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV blocks now; unknown or finished ids are ignored."""
        aborted = self.output_processor.abort_request(request_id, time.monotonic())
        if aborted is None:
            return
        child_ids, metrics = aborted
        for child_id in child_ids:
            self.scheduler.abort_request(child_id)
        self._publish(IterationStats(finished=[metrics]))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs of every request that progressed (cumulative text and tokens)."""
        plan = self.scheduler.schedule()
        sampled, stats = self._execute(plan)
        finished = self.scheduler.update(plan, {rid: t.token_id for rid, t in sampled.items()}, stats.step_duration_s)
        processed = self.output_processor.process(sampled, finished, time.monotonic(), stats)
        for request_id, stop in processed.stopped.items():
            self.scheduler.finish_request(request_id, "stop", stop)
        self._publish(stats)
        return processed.outputs

    def _execute(self, plan: StepPlan) -> tuple[dict[str, SampledToken], IterationStats]:
        """Run the plan, padded to `min_step_time_s` (the test-only capacity knob) if it ran anything."""
        started = time.monotonic()
        sampled = self.executor.execute(plan)
        if not plan.is_empty and self.config.min_step_time_s > 0:
            time.sleep(max(0.0, started + self.config.min_step_time_s - time.monotonic()))
        duration_s = time.monotonic() - started
        return sampled, IterationStats(step_duration_s=duration_s, num_preemptions=len(plan.preempted_request_ids))

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
