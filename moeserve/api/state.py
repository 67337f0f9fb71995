"""What the HTTP handlers share: the server's settings and the engine once it is loaded.

The server listens before the model is loaded, so orchestrators see a live process whose /health
answers 503 until `ServingState.set_ready` is called; requests meanwhile get a 503 too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from moeserve.api.errors import APIError
from moeserve.api.metrics import ServerMetrics
from moeserve.engine.async_engine import AsyncEngine
from moeserve.server_config import ServerSettings


@dataclass
class ModelInfo:
    """What the handlers need to know about the loaded model, read once at load."""

    max_model_len: int
    tokenizer: object
    """The HTTP side's own tokenizer instance: the engine thread decodes with another one, and a
    fast tokenizer must not be used from two threads at once."""
    root: str
    created: int = field(default_factory=lambda: int(time.time()))


class ServingState:
    """The engine, its model's facts, and whether the server still admits requests."""

    def __init__(self, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine: AsyncEngine | None = None
        self.model: ModelInfo | None = None
        self.draining = False

    def set_ready(self, engine: AsyncEngine, model: ModelInfo) -> None:
        self.model = model
        self.engine = engine

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_healthy and not self.draining

    def admit(self) -> tuple[AsyncEngine, ModelInfo]:
        """The engine for a new request, or a 503 saying why there is none."""
        if self.draining:
            raise APIError("the server is shutting down and admits no new requests", status_code=503)
        if self.engine is None or self.model is None:
            raise APIError("the model is still loading; retry shortly", status_code=503)
        if not self.engine.is_healthy:
            raise APIError("the engine has stopped; the server cannot serve requests", status_code=503)
        return self.engine, self.model
