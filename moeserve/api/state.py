"""What the HTTP handlers share: the server's settings and the engine once it is loaded.

The server listens before the model is loaded, so orchestrators see a live process whose /health
answers 503 until `ServingState.set_ready` is called; requests meanwhile get a 503 too.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from moeserve.api.errors import APIError
from moeserve.api.input_bounds import longest_token_chars
from moeserve.api.metrics import ServerMetrics
from moeserve.api.response_store import ResponseStore
from moeserve.engine.streams import EngineClient
from moeserve.engine_config import StructuredOutputsConfig
from moeserve.kv_transfer.identity import KvIdentity
from moeserve.server_config import ServerSettings
from moeserve.structured.compile_pool import GrammarCompilePool

T = TypeVar("T")


@dataclass
class ModelInfo:
    """What the handlers need to know about the loaded model, read once at load."""

    max_model_len: int
    tokenizer: object
    """The event loop's own tokenizer instance (logprob tokens, echoed prompts): a fast tokenizer
    must not be used from two threads at once, and the engine's output thread decodes with another."""
    root: str
    prompt_tokenizer: object | None = None
    """Another instance, used only on `prompt_thread` (see `off_loop`)."""
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeserve-prompts")
    )
    """Tokenization and chat templates run here, off the event loop: a long prompt or a large
    conversation takes milliseconds, which would stall every open stream's next chunk."""
    harmony: bool = False
    """The model speaks OpenAI's harmony format (gpt-oss): chat prompts are rendered and outputs
    read by `harmony`, not by the chat template and the --reasoning-parser/--tool-call-parser."""
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    """What a request's output constraint and tools may cost (the engine's config)."""
    grammars: GrammarCompilePool | None = None
    """Where constraints compile, out of the engine core; None: the engine compiles them (an
    in-process engine, whose step loop has no other clients to protect)."""
    kv: KvIdentity | None = None
    """This instance's part in prefill/decode disaggregation; None: colocated (`--role both`)."""

    @functools.cached_property
    def token_chars(self) -> int:
        """The most characters one token spells: with `max_model_len`, the longest text that can
        fit the context (`input_bounds.check_prompt_chars`). Read once, on first use."""
        return longest_token_chars(self.tokenizer)

    async def off_loop(self, work: Callable[[object], T]) -> T:
        """`work(prompt_tokenizer)` on the prompt thread (the loop's tokenizer if there is no other)."""
        tokenizer = self.prompt_tokenizer if self.prompt_tokenizer is not None else self.tokenizer
        return await asyncio.get_running_loop().run_in_executor(self.prompt_thread, work, tokenizer)


class ServingState:
    """The engine, its model's facts, and whether the server still admits requests."""

    def __init__(self, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine: EngineClient | None = None
        self.model: ModelInfo | None = None
        self.draining = False
        self.responses = ResponseStore(settings.responses_store_bytes)
        metrics.responses_store_bytes.set_function(lambda: self.responses.size)

    def set_ready(self, engine: EngineClient, model: ModelInfo) -> None:
        self.model = model
        self.engine = engine

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_healthy and not self.draining

    def admit(self) -> tuple[EngineClient, ModelInfo]:
        """The engine for a new request, or a 503 saying why there is none."""
        if self.draining:
            raise APIError("the server is shutting down and admits no new requests", status_code=503)
        if self.engine is None or self.model is None:
            raise APIError("the model is still loading; retry shortly", status_code=503)
        if not self.engine.is_healthy:
            raise APIError("the engine has stopped; the server cannot serve requests", status_code=503)
        return self.engine, self.model
