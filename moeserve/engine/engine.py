"""The engine: requests in, tokens out, one scheduler step at a time, all in the caller's thread.

    step():  core.step() (schedule -> execute -> update) -> frontend.process(...) -> RequestOutputs,
             and the sequences whose text matched a stop string finished in the core at once

`LLMEngine` is the frontend (`frontend.py`: tokenize, validate, fan out, detokenize) and the core
(`core.py`: scheduler and executor) in one object, which is what the offline `LLM` runs. The
server runs the same two apart: the frontend in its process, the core in its own. A request with
n > 1 fans out into n sequences (`<id>#<i>`) scheduled independently; its output gathers them.
Bad input raises ValueError before anything is queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve.config import EngineConfig, ModelConfig, parse_dtype
from moeserve.engine.core import EngineCore
from moeserve.engine.frontend import EngineFrontend, Prompt
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.stats import IterationStats, StatLogger
from moeserve.engine.tokenizer import load_tokenizer
from moeserve.models import model_config
from moeserve.models.checkpoint import read_json
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import SLORejectedError

logger = logging.getLogger(__name__)


def generation_eos_ids(folder: Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (often a list) and config.json, deduplicated."""
    path = folder / "generation_config.json"
    extra = read_json(path).get("eos_token_id") if path.exists() else None
    extra = [] if extra is None else (extra if isinstance(extra, list) else [extra])
    return tuple(dict.fromkeys([*config_eos, *extra]))


@dataclass(frozen=True)
class ModelFacts:
    """What both sides of the engine agree on about the checkpoint, read from its files alone."""

    model_config: ModelConfig
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    max_model_len: int

    @classmethod
    def read(cls, config: EngineConfig) -> ModelFacts:
        folder = Path(config.model)
        cfg = model_config(folder, config.indexer_key_dtype)
        max_model_len = config.max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        dtype = parse_dtype(config.dtype) or cfg.checkpoint_dtype
        return cls(cfg, dtype, generation_eos_ids(folder, cfg.eos_token_ids), max_model_len)


class LLMEngine:
    """Stat loggers get an `IterationStats` after every step and every abort (the caller's thread)."""

    def __init__(self, config: EngineConfig, stat_loggers: Sequence[StatLogger] = ()) -> None:
        self.config = config
        started = time.monotonic()
        facts = ModelFacts.read(config)
        self.model_config, self.dtype = facts.model_config, facts.dtype
        self.eos_token_ids, self.max_model_len = facts.eos_token_ids, facts.max_model_len
        self.tokenizer = load_tokenizer(Path(config.model))
        self.frontend = EngineFrontend(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len, config.slo, stat_loggers
        )
        self.core = EngineCore(config, self.model_config, self.dtype, self.max_model_len, self.eos_token_ids)
        self.scheduler, self.executor = self.core.scheduler, self.core.executor
        logger.info("engine ready in %.1f s (max_model_len %d)", time.monotonic() - started, self.max_model_len)

    @property
    def stat_loggers(self) -> list[StatLogger]:
        return self.frontend.stat_loggers

    def shutdown(self) -> None:
        """Stop the executor's processes, if any; the engine cannot step afterwards."""
        self.core.shutdown()

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """See `Executor.add_failure_listener`: a lost rank, reported from another thread."""
        self.core.add_failure_listener(listener)

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """A text prompt, `{"prompt_token_ids": [...]}` or a list of ids -> (text, ids)."""
        return self.frontend.tokenize(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Reject what the model cannot run; returns params with max_tokens fitted to the context."""
        return self.frontend.validate(prompt_token_ids, params)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        return self.add_requests([(prompt, params)], [request_id], arrival_time)[0]

    def add_requests(
        self,
        batch: list[tuple[Prompt, SamplingParams]],
        request_ids: list[str | None] | None = None,
        arrival_time: float | None = None,
    ) -> list[str]:
        """Tokenize and validate every (prompt, params) first, then queue them: a bad prompt
        anywhere raises ValueError with nothing of the batch queued."""
        prepared = [self.frontend.prepare(prompt, params) for prompt, params in batch]
        ids = request_ids or [None] * len(batch)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        added = []
        for (text, token_ids, params), request_id in zip(prepared, ids):
            request_id, samples = self.frontend.open(text, token_ids, params, request_id, arrival)
            try:
                predicted_ttft_s = self.core.add_requests(samples)
            except SLORejectedError:  # never queued, and not a missed request: admission said so at once
                self.frontend.close(request_id, time.monotonic())
                raise
            except Exception:  # e.g. QueueFullError: the request was never queued
                self.abort_request(request_id)
                raise
            if predicted_ttft_s is not None:
                self.frontend.mark_best_effort(request_id, predicted_ttft_s)
            added.append(request_id)
        return added

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its KV blocks now; unknown or finished ids are ignored."""
        closed = self.frontend.close(request_id, time.monotonic())
        if closed is None:
            return
        sequence_ids, metrics = closed
        self.core.abort_requests(sequence_ids)
        self.frontend.publish(IterationStats(finished=[metrics]), self.core.scheduler_stats())

    def has_unfinished_requests(self) -> bool:
        return self.frontend.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; outputs of every request that progressed (cumulative text and tokens)."""
        processed, stats = self.frontend.process(self.core.step())
        self.core.finish_requests(processed.stopped)
        self.frontend.publish(stats, self.core.scheduler_stats())
        return processed.outputs
