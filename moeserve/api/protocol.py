"""OpenAI's request and response bodies, as the official `openai` Python client sends and reads them.

Requests: `CompletionRequest` (/v1/completions) and `ChatCompletionRequest` (/v1/chat/completions)
take OpenAI's fields plus vLLM's extra sampling fields (top_k, min_p, ignore_eos, ...), because
vLLM's clients and benchmark tools send them. Unknown fields are ignored, as OpenAI and vLLM do,
but types are strict (`"0.5"` is not a temperature), so mistakes come back as a 400, not a guess.
Range checks live in `SamplingParams` only, so the HTTP and offline paths enforce the same rules;
`to_sampling_params` turns its `ValueError` into an `APIError` naming the request field.

Responses are built from the engine's `RequestOutput`s by the plain functions at the bottom; the
streaming code calls the `*_chunk` builders with one shared id and `created` per stream.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_serializer

from moeserve.api.constraints import (
    ChatTool,
    ResponseFormat,
    StructuredOutputsField,
    ToolChoice,
    output_constraint,
    tool_constraint,
)
from moeserve.api.errors import APIError, from_validation_error
from moeserve.api.input_bounds import MAX_STOP_TOKEN_IDS, check_stop
from moeserve.api.openapi import document_sampling_ranges
from moeserve.api.slo_request import SLOField, SLOUsage, slo_usage
from moeserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from moeserve.sampling_params import SamplingParams, StructuredOutputs

# Most samples one request may ask for: each sample holds its own KV blocks, so an unbounded n lets
# one request take the whole cache. vLLM has no bound; OpenAI's is 128, too many for one server.
MAX_N = 16
# OpenAI's limits on `logprobs` (completions) and `top_logprobs` (chat).
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
# OpenAI reports an impossible token as -9999.0, not -inf: JSON has no infinity.
MIN_LOGPROB = -9999.0


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the response builders use."""

    def decode(self, token_ids: list[int]) -> str: ...


def random_id(prefix: str) -> str:
    """An OpenAI-style id such as `cmpl-<32 hex>` or `chatcmpl-<32 hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    """Base of every body we parse: strict types, unknown fields ignored (OpenAI and vLLM do)."""

    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------- requests

RequestT = TypeVar("RequestT", bound=OpenAIModel)


def parse_request(model: type[RequestT], body: bytes | str | dict[str, Any]) -> RequestT:
    """Validate a request body (raw JSON or already decoded); any failure is a 400 `APIError`.

    Raw bytes are parsed by pydantic itself, so invalid JSON gets the same error shape as a bad field.
    """
    try:
        if isinstance(body, (bytes, str)):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """Send one last chunk with `usage` and no choices before `[DONE]`."""


class _SamplingRequest(OpenAIModel):
    """Fields shared by both endpoints: OpenAI's sampling fields and vLLM's extras."""

    model_config = ConfigDict(json_schema_extra=document_sampling_ranges)

    model: str | None = None
    """None lets the server pick its only model, as vLLM allows."""
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM's extra body fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    # Structured outputs: OpenAI's field, then vLLM's (see `constraints`).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    """vLLM's: each prompt token's logprob and this many top alternatives, in `prompt_logprobs`
    (at most 20, vLLM's default `max_logprobs`: each one is a top-k over the vocabulary per prompt
    token, computed in the engine core)."""
    # Per-request latency targets (moeserve's own), resolved by the handler against the server's classes.
    slo: SLOField | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: on a disaggregated instance, the KV transfer this request takes part in (`api.kv_transfer`)."""

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return check_stop(stop)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt position the engine must compute; None: no prompt logprobs."""
        return self.prompt_logprobs

    def _build_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        rename: dict[str, str],
        constraint: StructuredOutputs | None = None,
    ) -> SamplingParams:
        """SamplingParams from the shared fields; a bad value becomes a 400 naming the body field.

        SamplingParams starts every ValueError message with its field name; `rename` maps that name
        to the body field when they differ (chat's max_completion_tokens, top_logprobs).
        """
        fields = dict(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            priority=self.priority,
            structured_outputs=constraint if constraint is not None else output_constraint(self),
            prompt_logprobs=self._num_prompt_logprobs(),
        )
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            param = rename.get(field, field) if field in fields else None
            raise APIError(str(e), status_code=400, param=param) from None


_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "title": "Prompt",
    "description": "A text, token ids, or a list of either (one choice set per prompt)",
    "anyOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ],
}
"""What `_check_prompt` and the tokenizer accept, for the OpenAPI document (the validator's own
messages are clearer than pydantic's union errors, so it stays the check)."""


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(_PROMPT_SCHEMA, mode="validation")]
    max_tokens: int | None = 16
    """OpenAI's default is 16; an explicit null means up to the context length."""
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list) -> str | list:
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("must not be an empty list")
        for item in prompt:
            if isinstance(item, list) and not item:
                raise ValueError("token id lists must not be empty")
            ids = item if isinstance(item, list) else [item] if isinstance(item, int) else []
            if any(t < 0 for t in ids):
                raise ValueError("token ids must be >= 0")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompts one by one: a string or a list of token ids each."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    def _num_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` reports the prompt tokens' logprobs too, with as many alternatives."""
        if not (self.echo and self.logprobs is not None):
            return self.prompt_logprobs
        return max(self.logprobs, self.prompt_logprobs or 0)

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """`default_max_tokens` replaces an explicit `max_tokens: null` (the room left in the context)."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._build_sampling_params(max_tokens, self.logprobs, rename={})


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIModel):
    """One message of the conversation; content may be a string or a list of text parts."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    """None is allowed for an assistant turn that only called tools."""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's calls, as a response carried them."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Image, audio and file parts are refused by name: the models served are text models
        (the multimodal checkpoints, Kimi-K2.5's and Qwen3.5-MoE's, are served without their
        vision towers); checked before pydantic's union errors, which would list every form the
        content could have taken."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(
                    f"content part type {kind!r} is not supported: this server runs text models only, "
                    "and message content must be a string or a list of 'text' parts"
                )
        return content

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention: a call's arguments as a dict)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """A call from a request's history with its arguments parsed, where they are JSON."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    """Deprecated by OpenAI in favour of max_completion_tokens, but still sent by many clients."""
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, "none" without (OpenAI's defaults)."""
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: extra variables for the chat template, e.g. `{"enable_thinking": false}` for Qwen3."""
    reasoning_effort: Literal["low", "medium", "high"] = "medium"
    """How long a harmony model (gpt-oss) thinks, as its system message tells it; other models
    take their thinking switches through `chat_template_kwargs`."""

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template expects them: role and string content (and calls)."""
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's JSON form)."""
        return None if not self.tools else [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]

    @property
    def tool_mode(self) -> str:
        """ "none", "auto", "required" or "named": how tool calls are made and read."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        return choice if isinstance(choice, str) else "named"

    def to_sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        """max_completion_tokens wins over max_tokens; neither means `default_max_tokens`."""
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", status_code=400, param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        rename = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        constraint = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls)
        if constraint is not None and output_constraint(self) is not None:
            raise APIError(
                "a tool_choice that forces a call cannot be combined with an output constraint", param="tool_choice"
            )
        return self._build_sampling_params(max_tokens, logprobs, rename, constraint)


# ---------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    slo: SLOUsage | None = None
    """moeserve's own, sent only for a request admitted as best effort."""

    @model_serializer(mode="wrap")
    def _omit_no_slo(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("slo") is None:
            data.pop("slo", None)
        return data


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of vLLM's `prompt_logprobs`, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsBody = list[dict[int, PromptLogprob] | None]


def _drop_null_prompt_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `prompt_logprobs` only where asked: OpenAI's clients see OpenAI's keys otherwise."""
    if body.get("prompt_logprobs", 0) is None:
        del body["prompt_logprobs"]
    return body


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsBody | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _drop_null_prompt_logprobs(handler(self))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChunk(BaseModel):
    """Same `object` as the full response: OpenAI streams completions as "text_completion" too."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI sends them."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _OmitNone(BaseModel):
    """A stream delta piece: OpenAI omits the keys a delta does not carry rather than sending nulls."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    """A call's first delta carries its id, type and name; later ones argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    """A reasoning model's thinking (`--reasoning-parser`), as vLLM sends it; sent only then."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Sent only when there are calls, as OpenAI does."""

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsBody | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        return _drop_null_prompt_logprobs(handler(self))


class DeltaMessage(_OmitNone):
    """A stream delta: role on a choice's first chunk, content or tool calls after, `{}` on the last one."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "moeserve"
    root: str | None = None
    """The checkpoint folder it was loaded from (vLLM reports the same)."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------- logprob conversion


def _token_text(tokenizer: Tokenizer, token_id: int, logprob: Logprob) -> str:
    """The token as text: the engine's own decoding when it has one, else a one-token decode."""
    return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _by_likelihood(alternatives: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """Alternatives most likely first; ties keep the engine's order (sort is stable)."""
    return sorted(alternatives.items(), key=lambda item: -item[1].logprob)


def _prompt_alternatives(entry: dict[int, Logprob], token_id: int, num_top: int) -> dict[int, Logprob]:
    """A prompt position's token and its `num_top` most likely alternatives (the engine may have
    computed more, when `echo` and `prompt_logprobs` asked for different numbers)."""
    return {t: lp for t, lp in entry.items() if t == token_id or (lp.rank is not None and lp.rank <= num_top)}


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]],
    tokenizer: Tokenizer,
    prompt_token_ids: list[int] | None = None,
    start_offset: int = 0,
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
    num_prompt_top: int = 0,
) -> CompletionLogprobs:
    """The legacy format for generated tokens, preceded by echoed prompt tokens if given.

    Each position's dict holds the sampled token and the top alternatives, so `top_logprobs` may
    have logprobs + 1 entries, as OpenAI documents. Echoed prompt tokens take their logprobs from
    `prompt_logprobs` (the first token's is null: nothing precedes it), with `num_prompt_top`
    alternatives. `text_offset` counts characters from the start of the text; a stream's later
    chunks pass the characters already sent as `start_offset`.
    """
    result = CompletionLogprobs()
    offset = start_offset
    for index, token_id in enumerate(prompt_token_ids or []):
        text = tokenizer.decode([token_id])
        entry = prompt_logprobs[index] if prompt_logprobs is not None else None
        result.tokens.append(text)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            kept = _prompt_alternatives(entry, token_id, num_prompt_top)
            result.token_logprobs.append(_clamp(entry[token_id].logprob))
            result.top_logprobs.append(
                {_token_text(tokenizer, t, lp): _clamp(lp.logprob) for t, lp in _by_likelihood(kept)}
            )
        result.text_offset.append(offset)
        offset += len(text)
    for token_id, alternatives in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id, alternatives[token_id])
        result.tokens.append(text)
        result.token_logprobs.append(_clamp(alternatives[token_id].logprob))
        result.top_logprobs.append(
            {_token_text(tokenizer, t, lp): _clamp(lp.logprob) for t, lp in _by_likelihood(alternatives)}
        )
        result.text_offset.append(offset)
        offset += len(text)
    return result


def _top_logprob(tokenizer: Tokenizer, token_id: int, logprob: Logprob) -> TopLogprob:
    text = _token_text(tokenizer, token_id, logprob)
    return TopLogprob(token=text, logprob=_clamp(logprob.logprob), bytes=list(text.encode("utf-8")))


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]], tokenizer: Tokenizer, num_top: int
) -> ChatLogprobs:
    """The chat format: per token its logprob, UTF-8 bytes and exactly `num_top` alternatives."""
    content = []
    for token_id, alternatives in zip(token_ids, logprobs):
        sampled = _top_logprob(tokenizer, token_id, alternatives[token_id])
        top = [_top_logprob(tokenizer, t, lp) for t, lp in _by_likelihood(alternatives)[:num_top]]
        content.append(ChatLogprobToken(**sampled.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


# ---------------------------------------------------------------- response builders


def usage_info(outputs: list[RequestOutput]) -> UsageInfo:
    """Tokens of every prompt and every sample of `outputs`."""
    prompt = sum(len(out.prompt_token_ids) for out in outputs)
    completion = sum(len(sample.token_ids) for out in outputs for sample in out.outputs)
    total = prompt + completion
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total, slo=slo_usage(outputs))


def _prompt_text(output: RequestOutput, tokenizer: Tokenizer) -> str:
    """The prompt as text; a prompt given as token ids is decoded."""
    return output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)


def prompt_logprobs_body(output: RequestOutput, tokenizer: Tokenizer, num_top: int | None) -> PromptLogprobsBody | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first is null) the token and `num_top`
    alternatives by token id, each with its logprob, rank and text; None unless asked."""
    if num_top is None or output.prompt_logprobs is None:
        return None
    body: PromptLogprobsBody = []
    for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
        if entry is None:
            body.append(None)
            continue
        kept = _prompt_alternatives(entry, token_id, num_top)
        body.append(
            {
                t: PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=_token_text(tokenizer, t, lp))
                for t, lp in kept.items()
            }
        )
    return body


def _completion_choice(
    index: int,
    output: RequestOutput,
    sample: CompletionOutput,
    tokenizer: Tokenizer,
    echo: bool,
    num_echo_top: int,
    prompt_logprobs: PromptLogprobsBody | None,
) -> CompletionChoice:
    logprobs = None
    if sample.logprobs is not None:
        echoed = output.prompt_token_ids if echo else None
        logprobs = completion_logprobs(
            sample.token_ids,
            sample.logprobs,
            tokenizer,
            echoed,
            prompt_logprobs=output.prompt_logprobs,
            num_prompt_top=num_echo_top,
        )
    text = _prompt_text(output, tokenizer) + sample.text if echo else sample.text
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=sample.finish_reason, prompt_logprobs=prompt_logprobs
    )


def completion_response(
    request_id: str,
    model: str,
    outputs: list[RequestOutput],
    tokenizer: Tokenizer,
    echo_prompts: bool = False,
    num_logprobs: int = 0,
    num_prompt_logprobs: int | None = None,
) -> CompletionResponse:
    """One response for all prompts of a request; choice i * n + j is sample j of prompt i.
    `num_logprobs`: alternatives per echoed prompt token; `num_prompt_logprobs`: vLLM's field."""
    choices = []
    for prompt_index, output in enumerate(outputs):
        n = len(output.outputs)
        prompt_logprobs = prompt_logprobs_body(output, tokenizer, num_prompt_logprobs)
        for sample in output.outputs:
            choices.append(
                _completion_choice(
                    prompt_index * n + sample.index,
                    output,
                    sample,
                    tokenizer,
                    echo_prompts,
                    num_logprobs,
                    prompt_logprobs,
                )
            )
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage_info(outputs))


def chat_response(
    request_id: str,
    model: str,
    output: RequestOutput,
    tokenizer: Tokenizer,
    num_top_logprobs: int = 0,
    read: Callable[[str, str | None], tuple[str | None, str | None, list[ToolCall], str | None]] | None = None,
    num_prompt_logprobs: int | None = None,
) -> ChatCompletionResponse:
    """A chat response with one choice per sample; logprobs where the engine returned them.
    `read(text, finish_reason) -> (reasoning, content, tool calls, finish_reason)` for a request
    whose output may hold reasoning or tool calls."""
    choices = []
    for sample in output.outputs:
        reasoning, content, calls, finish_reason = None, sample.text, [], sample.finish_reason
        if read is not None:
            reasoning, content, calls, finish_reason = read(sample.text, sample.finish_reason)
        logprobs = None
        if sample.logprobs is not None:
            logprobs = chat_logprobs(sample.token_ids, sample.logprobs, tokenizer, num_top_logprobs)
        message = ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
        choices.append(ChatChoice(index=sample.index, message=message, logprobs=logprobs, finish_reason=finish_reason))
    return ChatCompletionResponse(
        id=request_id,
        model=model,
        choices=choices,
        usage=usage_info([output]),
        prompt_logprobs=prompt_logprobs_body(output, tokenizer, num_prompt_logprobs),
    )


# ---------------------------------------------------------------- streaming


SSE_DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel) -> str:
    """One server-sent event carrying `chunk` as JSON."""
    return f"data: {chunk.model_dump_json()}\n\n"


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: str | None = None,
    logprobs: CompletionLogprobs | None = None,
) -> CompletionStreamChunk:
    """A streamed piece of completion choice `index`."""
    choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
    return CompletionStreamChunk(id=request_id, created=created, model=model, choices=[choice])


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    index: int,
    delta: DeltaMessage,
    finish_reason: str | None = None,
    logprobs: ChatLogprobs | None = None,
) -> ChatCompletionStreamChunk:
    """A streamed piece of chat choice `index`; the first one carries `DeltaMessage(role="assistant", content="")`."""
    choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    return ChatCompletionStreamChunk(id=request_id, created=created, model=model, choices=[choice])


def completion_usage_chunk(request_id: str, model: str, created: int, usage: UsageInfo) -> CompletionStreamChunk:
    """The last chunk of a stream with include_usage: no choices, just the totals."""
    return CompletionStreamChunk(id=request_id, created=created, model=model, choices=[], usage=usage)


def chat_usage_chunk(request_id: str, model: str, created: int, usage: UsageInfo) -> ChatCompletionStreamChunk:
    """The last chunk of a chat stream with include_usage: no choices, just the totals."""
    return ChatCompletionStreamChunk(id=request_id, created=created, model=model, choices=[], usage=usage)
