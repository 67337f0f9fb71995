"""What the engine returns, in vLLM's shape so vLLM users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.engine.stats import RequestMetrics


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per output token: sampled + top-k alternatives
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None  # set on the finished output: latencies and SLO verdicts
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Per prompt token (the first's is None): its logprob and the top alternatives, as vLLM's;
    None unless `SamplingParams.prompt_logprobs` was set."""
