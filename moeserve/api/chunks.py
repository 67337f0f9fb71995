"""Server-sent events for streamed choices, rendered from per-stream templates.

A streaming server writes one chunk per stream per engine step: with 64 streams that is 64
chunks every few milliseconds. Building each through the pydantic models in `protocol.py` cost
about 20 us a chunk, most of the API process's time per token. Within one stream only the
choice index, its text and its finish reason change from chunk to chunk, so the rest is
rendered once and each chunk is a string concatenation. The output is byte for byte what
`sse(completion_chunk(...))` and `sse(chat_chunk(...))` produce (tests compare them); chunks with
logprobs, rare and larger, still go through the models.
"""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import Literal

from moeserve.api.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    DeltaMessage,
    DeltaToolCall,
    chat_chunk,
    completion_chunk,
    sse,
)

json_string = encode_basestring
"""A str as a JSON string, non-ASCII characters kept as they are (as pydantic writes them)."""


def _json_reason(finish_reason: str | None) -> str:
    return "null" if finish_reason is None else json_string(finish_reason)


def _head(request_id: str, obj: str, created: int, model: str) -> str:
    return (
        f'data: {{"id":{json_string(request_id)},"object":"{obj}","created":{int(created)},'
        f'"model":{json_string(model)},"system_fingerprint":null,"choices":[{{"index":'
    )


class CompletionChunks:
    """The SSE events of one /v1/completions stream (`object: text_completion`)."""

    def __init__(self, request_id: str, model: str, created: int) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self._head = _head(request_id, "text_completion", created, model)

    def event(
        self, index: int, text: str, finish_reason: str | None = None, logprobs: CompletionLogprobs | None = None
    ) -> str:
        """What `sse(completion_chunk(request_id, model, created, index, text, finish_reason, logprobs))` is."""
        if logprobs is not None:
            chunk = completion_chunk(self.request_id, self.model, self.created, index, text, finish_reason, logprobs)
            return sse(chunk)
        return (
            f'{self._head}{index},"text":{json_string(text)},"logprobs":null,'
            f'"finish_reason":{_json_reason(finish_reason)}}}],"usage":null}}\n\n'
        )


class ChatChunks:
    """The SSE events of one /v1/chat/completions stream (`object: chat.completion.chunk`)."""

    def __init__(self, request_id: str, model: str, created: int) -> None:
        self.request_id, self.model, self.created = request_id, model, created
        self._head = _head(request_id, "chat.completion.chunk", created, model)

    def event(
        self,
        index: int,
        content: str | None,
        finish_reason: str | None = None,
        logprobs: ChatLogprobs | None = None,
        role: Literal["assistant"] | None = None,
        tool_calls: list[DeltaToolCall] | None = None,
        reasoning: str | None = None,
    ) -> str:
        """What `sse(chat_chunk(...))` is for a delta of `role`, `content`, `reasoning`
        (`reasoning_content`) and `tool_calls` (None or no calls: key left out). Tool call deltas
        take the models."""
        if logprobs is not None or tool_calls:
            delta = DeltaMessage(role=role, content=content, reasoning_content=reasoning, tool_calls=tool_calls or None)
            return sse(chat_chunk(self.request_id, self.model, self.created, index, delta, finish_reason, logprobs))
        fields = [] if role is None else ['"role":"assistant"']
        if content is not None:
            fields.append(f'"content":{json_string(content)}')
        if reasoning is not None:
            fields.append(f'"reasoning_content":{json_string(reasoning)}')
        delta = "{" + ",".join(fields) + "}"
        return (
            f'{self._head}{index},"delta":{delta},"logprobs":null,'
            f'"finish_reason":{_json_reason(finish_reason)}}}],"usage":null}}\n\n'
        )
