"""The `speculative_config` option: vLLM's keys, checked when the engine is configured."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "mtp")
"""Draft methods this engine runs: prompt lookup, and the checkpoint's multi-token prediction
layers (DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5; a checkpoint without them is refused when the model loads)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How each decode step drafts tokens for the target model to verify in the same forward."""

    method: str
    """Where drafts come from: "ngram" (prompt lookup: the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens) or "mtp" (the checkpoint's multi-token prediction
    layers, run by the model runner on the target's hidden states)."""
    num_speculative_tokens: int
    """Draft tokens proposed per sequence and step (at most; a step may draft fewer)."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix of the sequence searched for earlier in it."""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix searched for; longer matches are tried first."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config: method {self.method!r} is not supported "
                f"(the methods are: {', '.join(SPECULATIVE_METHODS)})"
            )
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                "speculative_config: num_speculative_tokens must be an integer >= 1, "
                f"got {self.num_speculative_tokens!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @property
    def mtp_drafts(self) -> int:
        """Drafts the model runner's MTP layers make per decode (0 unless the method is mtp)."""
        return self.num_speculative_tokens if self.method == "mtp" else 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From the option's JSON object; an unknown key is refused by name, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in values:
                raise ValueError(f"speculative_config: {key!r} is required")
        return cls(**values)


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """The flag's JSON text, `LLM(speculative_config={...})`'s dict, or a config already built."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
    return SpeculativeConfig.from_dict(value)
