"""The `slo` body field: a request's own latency targets, or the name of a server class.

    "slo": {"ttft_ms": 500, "tbt_ms": 50}    own targets (either may be left to the server's)
    "slo": {"class": "chat"}                 a class defined with --slo-class

Resolved against the server's `SLOCatalog` into the `RequestSLO` the engine schedules, admits
and judges by. A bad value is a 400 naming `slo`, in OpenAI's error format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moeserve.api.errors import APIError
from moeserve.engine.outputs import RequestOutput
from moeserve.slo import RequestSLO, SLOCatalog


class SLOField(BaseModel):
    """Strict like the other body models (`protocol.OpenAIModel`), but an unknown key is an error:
    a misspelt target silently ignored would be a promise the client thinks it has."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tbt_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    class_name: str | None = Field(None, alias="class")

    @model_validator(mode="after")
    def _class_or_targets(self) -> SLOField:
        if self.class_name is not None and (self.ttft_ms is not None or self.tbt_ms is not None):
            raise ValueError("give either a class or targets (ttft_ms, tbt_ms), not both")
        return self

    def resolve(self, catalog: SLOCatalog) -> RequestSLO:
        """The targets this field asks for, labelled by the class they belong to."""
        try:
            if self.class_name is not None:
                return catalog.named(self.class_name)
            return catalog.resolve(
                None if self.ttft_ms is None else self.ttft_ms / 1000.0,
                None if self.tbt_ms is None else self.tbt_ms / 1000.0,
            )
        except ValueError as e:
            raise APIError(str(e), status_code=400, param="slo") from None


class SLOUsage(BaseModel):
    """`usage.slo` of a request SLO admission took as best effort (`--slo-admission degrade`): its
    TTFT target was predicted to be missed, and the client is told so rather than left to find out."""

    admitted: Literal["best_effort"] = "best_effort"
    predicted_ttft_ms: float


def slo_usage(outputs: Sequence[RequestOutput]) -> SLOUsage | None:
    """The `usage.slo` of finished `outputs` (the prompts of one response): the worst prediction
    among those admitted as best effort, or None if every one was admitted on a promise."""
    predicted = [
        out.metrics.best_effort_ttft_s
        for out in outputs
        if out.metrics is not None and out.metrics.best_effort_ttft_s is not None
    ]
    return SLOUsage(predicted_ttft_ms=round(max(predicted) * 1000.0, 1)) if predicted else None
