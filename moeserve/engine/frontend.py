"""The engine's client side: everything done with a request that is not stepping the model.

    prompt -> tokenize -> validate -> fan out n samples -> CoreRequests   (to the core)
    CoreStep -> detokenize, stop strings, latencies -> RequestOutputs + IterationStats   (from it)

It runs wherever the client is: beside the core in `LLMEngine`, or in the API server's process
while the core steps in its own (`core_client.py`). It needs the tokenizer and the model's
limits, never its weights.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import replace

from moeserve.config import SLOConfig
from moeserve.engine.core import CoreRequest, CoreStep, SchedulerStats
from moeserve.engine.output_processor import OutputProcessor, ProcessedStep
from moeserve.engine.stats import IterationStats, RequestMetrics, StatLogger
from moeserve.sampling_params import SamplingParams
from moeserve.structured import check_structured_outputs

logger = logging.getLogger(__name__)

Prompt = str | dict | list[int]


class EngineFrontend:
    """Requests in and outputs out, for one model; single-threaded (its tokenizer is too)."""

    def __init__(
        self,
        tokenizer: object,
        vocab_size: int,
        max_model_len: int,
        slo: SLOConfig,
        stat_loggers: Sequence[StatLogger] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.stat_loggers = list(stat_loggers)
        self.output_processor = OutputProcessor(tokenizer, slo)
        self._ids = itertools.count()

    # ---- requests in ------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
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
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is out of the vocabulary [0, {vocab})")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's maximum context length is "
                f"{self.max_model_len}, which leaves no room for a generated token"
            )
        spec = params.structured_outputs
        if spec is not None and spec.compiled is None:  # a compiled one was checked where it compiled
            check_structured_outputs(spec)  # a grammar that does not parse is the caller's error
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))

    def prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Tokenize and validate: (text, token ids, fitted params); ValueError for bad input."""
        text, prompt_token_ids = self.tokenize(prompt)
        return text, prompt_token_ids, self.validate(prompt_token_ids, params)

    def open(
        self,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        arrival: float,
    ) -> tuple[str, list[CoreRequest]]:
        """Track a prepared request: (its id, its samples for the core to add, all or none)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = []
        for i in range(params.n):
            sample_params = params if params.n == 1 or params.seed is None else replace(params, seed=params.seed + i)
            sample_id = request_id if params.n == 1 else f"{request_id}#{i}"
            samples.append(CoreRequest(sample_id, list(prompt_token_ids), sample_params, arrival))
        sample_ids = [s.request_id for s in samples]
        self.output_processor.add_request(request_id, text, prompt_token_ids, params, arrival, sample_ids)
        return request_id, samples

    def close(self, request_id: str, now: float) -> tuple[list[str], RequestMetrics] | None:
        """Forget an unfinished request: (its sequence ids for the core to abort, its metrics);
        None if it is unknown or finished."""
        return self.output_processor.abort_request(request_id, now)

    def mark_best_effort(self, request_id: str, predicted_ttft_s: float) -> None:
        """The core admitted `request_id` as best effort: SLO admission predicted this TTFT, over
        its target. Its final metrics say so, and the API its usage."""
        self.output_processor.mark_best_effort(request_id, predicted_ttft_s)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    # ---- outputs back -----------------------------------------------------------------------

    def process(self, step: CoreStep) -> tuple[ProcessedStep, IterationStats]:
        """A core step's outputs, and its stats (gauges still to be set by `publish`)."""
        stats = IterationStats(
            step_duration_s=step.step_duration_s,
            num_preemptions=step.num_preemptions,
            routed_tokens=step.routed_tokens,
            rebalances=step.rebalances,
            heals=step.heals,
            rejoins=step.rejoins,
            prefix_cache_queries=step.prefix_cache_queries,
            prefix_cache_hits=step.prefix_cache_hits,
            spec_decode=step.spec_decode,
        )
        return self.output_processor.process(step, stats), stats

    def publish(self, stats: IterationStats, gauges: SchedulerStats) -> None:
        """Set the gauges and hand the stats to every logger; a failing logger never stops serving."""
        stats.num_running = gauges.num_running
        stats.num_waiting = gauges.num_waiting
        stats.kv_blocks_used = gauges.kv_blocks_used
        stats.kv_blocks_total = gauges.kv_blocks_total
        stats.state_slots_used = gauges.state_slots_used
        stats.state_slots_total = gauges.state_slots_total
        stats.saved_states_held = gauges.saved_states_held
        stats.saved_states_total = gauges.saved_states_total
        stats.group_blocks = gauges.group_blocks
        stats.ttft_promised = gauges.ttft_promised
        stats.ttft_promises_kept = gauges.ttft_promises_kept
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:
                logger.exception("stat logger %r failed; the engine keeps serving", stat_logger)
