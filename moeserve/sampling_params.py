"""Per-request sampling parameters, with vLLM's names, defaults and meaning.

The API layer builds one `SamplingParams` per request from the OpenAI body; the scheduler reads the
stop conditions (`max_tokens`, `stop`, `stop_token_ids`, `ignore_eos`, `min_tokens`) and the
sampler reads the rest. Keeping vLLM's semantics lets clients switch servers without surprises.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Literal

from moeserve.slo import RequestSLO

# Temperatures below this count as 0 (greedy): dividing logits by a tiny number only amplifies
# noise, and it is the threshold vLLM uses.
SAMPLING_EPS = 1e-5
# Largest `logprobs` a request may ask for (OpenAI's limit for top logprobs; vLLM's default).
MAX_LOGPROBS = 20
# The integers the engine carries in int64 tensors and msgpack frames: a larger seed, top_k or
# stop token id would fail the engine core's step (and with it every request), not just its own.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# What a request carries when its KV crosses instances (the body's `kv_transfer_params`). It lives
# here, not in `moeserve.kv_transfer`, because it travels inside SamplingParams through the
# scheduler, which that package's coordinator itself builds on.
@dataclass(frozen=True)
class KvTransferParams:
    """On a prefill instance (`remote` None): hold the prompt's KV for `transfer_id`. On a decode
    instance: load it from the prefill instance whose side channel is at `remote` (host:port)."""

    transfer_id: str
    remote: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.transfer_id, str) or not self.transfer_id:
            raise ValueError("kv_transfer_params transfer_id must be a non-empty string")
        if self.remote is not None and (not isinstance(self.remote, str) or ":" not in self.remote):
            raise ValueError(f"kv_transfer_params remote must be host:port, got {self.remote!r}")


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the whole output, as vLLM's `StructuredOutputsParams` (one kind at a time).

    `spec` is text in every kind, so the pair is the grammar's cache key and crosses the engine's
    wire as two strings: a JSON schema (serialised) for "json", a regex for "regex", a JSON list
    of strings for "choice", an EBNF grammar (xgrammar's dialect, `root` first) for "grammar";
    "json_object" (any JSON object) ignores it.

    A reasoning model thinks before it answers, and the constraint is on the answer: with
    `reasoning_end` set, the output is free text without that marker, the marker, then the
    constrained answer (`structured.grammar.after_reasoning`).
    """

    kind: StructuredKind
    spec: str = ""
    reasoning_start: str = ""
    """What opens the thinking when the model opens it itself (it may also answer at once);
    empty: the prompt has opened it, so the output thinks first."""
    reasoning_end: str = ""
    """What closes the thinking; empty: the output is all answer."""
    compiled: str | None = field(default=None, compare=False, repr=False)
    """The grammar already compiled for the served tokenizer (xgrammar's serialized form, of the
    whole constraint: the thinking before the answer too): the server compiles in worker processes
    and sends it with the request, so the engine core only loads it. Not part of the key; None:
    the engine compiles it (offline use)."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_outputs kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}")
        for name in ("spec", "reasoning_start", "reasoning_end"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(
                    f"structured_outputs {name} must be a string, got {type(getattr(self, name)).__name__}"
                )
        if self.reasoning_start and not self.reasoning_end:
            raise ValueError("structured_outputs reasoning_start needs reasoning_end")

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputs:
        """One of these strings, exactly."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("structured_outputs choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutputs:
        """Output that validates against `schema` (a dict, or its JSON text)."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop.

    `__post_init__` normalises the lenient forms clients send (`top_k=-1`, a single stop string,
    `seed=-1`) so the sampler and scheduler see one form only, and rejects out-of-range values with
    a `ValueError` naming the field, which the API turns into an HTTP 400.
    """

    n: int = 1
    """Number of completions to return for the prompt."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 (or -1, normalised to 0) turns it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Seed of the request's own random generator, for reproducible sampling; None: global RNG."""
    stop: list[str] | str | None = None
    """Strings that end generation when produced (normalised to a list)."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation besides EOS (normalised to a list)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it to get fixed-length outputs)."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top logprobs; None: return none."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI's definition)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in prompt or output; 1 is off."""
    min_tokens: int = 0
    """EOS and stop_token_ids are masked until this many tokens have been generated."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the returned text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenised text."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the output to a grammar (JSON schema, regex, choice, EBNF); None: free text.
    A (kind, spec) pair is accepted too, which is how the engine's wire carries it."""
    prompt_logprobs: int | None = None
    """Return each prompt token's logprob (the first has none) plus this many top logprobs per
    prompt position; None: return none. Costs a vocabulary projection per prompt token."""
    priority: int = 0
    """Admission order among queued requests, lower first (vLLM's meaning); ties keep the
    policy's own order (arrival under fcfs, TTFT deadline under slo)."""
    slo: RequestSLO | None = None
    """This request's own latency targets; None: the server's. A (ttft_s, tbt_s, label) triple is
    accepted too, which is how the engine's wire carries it."""
    kv_transfer: KvTransferParams | None = None
    """Prefill/decode disaggregation: hold this prompt's KV for a decode instance (prefill role), or
    load it from a prefill instance (decode role). A (transfer_id, remote) pair on the wire."""

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if isinstance(self.structured_outputs, (list, tuple)):
            self.structured_outputs = StructuredOutputs(*self.structured_outputs)
        if isinstance(self.slo, (list, tuple)):
            self.slo = RequestSLO(*self.slo)
        if isinstance(self.kv_transfer, (list, tuple)):
            self.kv_transfer = KvTransferParams(*self.kv_transfer)
        self._validate()

    def _validate(self) -> None:
        """Check every field; comparisons are written `not (ok)` so that NaN fails them too."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1 or None"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.top_k <= INT64_MAX, "top_k", "must be >= 1 (and < 2**63), or 0 or -1 to disable"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}] or None",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}] or None",
            ),
            (
                self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
                "min_tokens",
                "must be >= 0 and <= max_tokens",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids", "must be in [0, 2**63)"),
            (self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "must be in [-2**63, 2**63)"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax: temperature ~0, or top_k == 1.

        top_k == 1 would pick the argmax anyway; routing it to the argmax path makes the two
        agree exactly, ties included, and skips drawing random numbers.
        """
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def clone(self) -> SamplingParams:
        """A deep copy, so per-sample tweaks (e.g. a derived seed for n > 1) never alias lists."""
        return copy.deepcopy(self)
