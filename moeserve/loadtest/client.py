"""One streamed request to an OpenAI-compatible server, timed on the client's monotonic clock.

The request asks for usage in the stream (`stream_options.include_usage`), so token counts are
the server's own; without a usage chunk they come from a tokenizer when one is given, else one
token per content chunk. A *content chunk* is a chunk whose first choice carries non-empty
text (`text`, or chat's `delta.content` / `delta.reasoning_content`): chat's opening role-only
delta and a bare finish chunk carry no token and would otherwise fake a first token or a gap.

HTTP goes through an `Opener` (POST a JSON body, get a status and a byte stream), so the timing
and parsing are tested against a fake stream with a fake clock; `aiohttp_opener` is the real one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from moeserve.loadtest.datasets import Prompt

ERROR_TYPES = ("http_4xx", "http_5xx", "timeout", "connection_error", "stream_error", "empty_output")
"""Why a request failed: its HTTP status class (other classes read `http_<digit>xx`), no complete
answer within --timeout, a transport failure or a stream cut before [DONE], an error event (or an
aborted choice) inside a 200 stream, or a stream that finished without any content."""

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestRecord:
    """What the client saw of one request; `metrics` derives every figure from it."""

    index: int
    """Position of the prompt in the run."""
    send_time: float
    """Clock reading just before the request was opened."""
    end_time: float = 0.0
    """Clock reading at [DONE], at the failure, or at the timeout."""
    chunk_times: list[float] = field(default_factory=list)
    """Clock reading at the arrival of every content chunk."""
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int = 0
    token_source: str = ""
    """Where `output_tokens` came from: "usage", "tokenizer" or "chunks"."""
    error: str | None = None
    """One of `ERROR_TYPES`, or None on success."""
    error_detail: str = ""


@dataclass(frozen=True)
class HTTPResponse:
    status: int
    body: AsyncIterator[bytes]
    """The response body as it arrives over the network, in whatever pieces."""


Opener = Callable[[str, dict[str, Any]], AbstractAsyncContextManager[HTTPResponse]]
"""POST `payload` as JSON to `path` (e.g. /v1/completions); the response while it streams."""


def aiohttp_opener(session: aiohttp.ClientSession, base_url: str) -> Opener:
    @asynccontextmanager
    async def open_stream(path: str, payload: dict[str, Any]) -> AsyncIterator[HTTPResponse]:
        async with session.post(base_url + path, json=payload) as response:
            yield HTTPResponse(response.status, response.content.iter_any())

    return open_stream


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a benchmark shares."""

    endpoint: str
    """"completions" or "chat"."""
    model: str
    ignore_eos: bool
    """Send vLLM's `ignore_eos` extension, so every request generates exactly max_tokens."""
    timeout_s: float
    """The whole request, first byte to [DONE]; past it the request is cancelled."""


def request_payload(settings: RequestSettings, prompt: Prompt) -> tuple[str, dict[str, Any]]:
    """The route and JSON body of a streamed request for `prompt` (a text prompt for chat)."""
    body: dict[str, Any] = {"model": settings.model, "stream": True, "stream_options": {"include_usage": True}}
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.prompt}]
        body["max_completion_tokens"] = prompt.output_len
    else:
        body["prompt"] = prompt.prompt
        body["max_tokens"] = prompt.output_len
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if prompt.slo_ms is not None:
        body["slo"] = {"ttft_ms": prompt.slo_ms[0], "tbt_ms": prompt.slo_ms[1]}
    return ENDPOINTS[settings.endpoint], body


class SSEDecoder:
    """Server-sent events: bytes in, each event's `data` out. An event may span network reads
    and one read may hold many events; lines end with LF or CRLF, `:` lines are comments."""

    def __init__(self) -> None:
        self._partial = b""
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        """The data of every event that `piece` completes."""
        *lines, self._partial = (self._partial + piece).split(b"\n")
        events = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append(value.removeprefix(b" ").decode("utf-8", errors="replace"))
        return events


@dataclass(frozen=True)
class StreamEvent:
    """The parts of one streamed chunk that matter for timing and counting."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None


def parse_event(data: str) -> StreamEvent:
    """One SSE data payload (JSON) of a completions or chat stream."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return StreamEvent(error=f"malformed chunk: {data[:200]!r}")
    if not isinstance(chunk, dict):
        return StreamEvent(error=f"malformed chunk: {data[:200]!r}")
    if chunk.get("error") is not None:
        error = chunk["error"]
        return StreamEvent(error=str(error.get("message", error) if isinstance(error, dict) else error))
    usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return StreamEvent(usage=usage)
    choice = choices[0]
    delta = choice.get("delta") or {}
    text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
    return StreamEvent(text=text, finish_reason=choice.get("finish_reason"), usage=usage)


async def send_request(
    open_stream: Opener,
    settings: RequestSettings,
    index: int,
    prompt: Prompt,
    *,
    clock: Callable[[], float] = time.monotonic,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestRecord:
    """Send one streamed request and time it; never raises for what the server or network does."""
    path, payload = request_payload(settings, prompt)
    record = RequestRecord(index=index, send_time=clock())
    completion_tokens = None
    try:
        completion_tokens = await asyncio.wait_for(
            _exchange(open_stream, path, payload, record, clock), settings.timeout_s
        )
    except asyncio.TimeoutError:
        record.error, record.error_detail = "timeout", f"no complete answer within {settings.timeout_s:g} s"
        record.end_time = clock()
    except (aiohttp.ClientError, OSError) as e:
        record.error, record.error_detail = "connection_error", f"{type(e).__name__}: {e}"
        record.end_time = clock()
    if record.error is None and not record.chunk_times:
        record.error, record.error_detail = "empty_output", "the stream finished without any content"
    if record.error is None:
        if completion_tokens is not None:
            record.output_tokens, record.token_source = completion_tokens, "usage"
        elif count_tokens is not None:
            record.output_tokens, record.token_source = count_tokens(record.text), "tokenizer"
        else:
            record.output_tokens, record.token_source = len(record.chunk_times), "chunks"
    if record.prompt_tokens is None:
        record.prompt_tokens = prompt.prompt_len
    return record


async def _exchange(
    open_stream: Opener, path: str, payload: dict[str, Any], record: RequestRecord, clock: Callable[[], float]
) -> int | None:
    """Read the response into `record` (which outlives a cancellation); the usage's completion
    tokens, if the server sent them."""
    completion_tokens = None
    async with open_stream(path, payload) as response:
        if response.status != 200:
            body = b"".join([piece async for piece in response.body]).decode("utf-8", errors="replace")
            record.error, record.error_detail = (
                f"http_{response.status // 100}xx",
                f"HTTP {response.status}: {body[:300]}",
            )
            record.end_time = clock()
            return None
        decoder = SSEDecoder()
        pieces = []
        async for data in response.body:
            now = clock()
            for event_data in decoder.feed(data):
                if event_data == "[DONE]":
                    record.text, record.end_time = "".join(pieces), now
                    return completion_tokens
                event = parse_event(event_data)
                if event.error is None and event.finish_reason == "abort":
                    event = StreamEvent(error="the server aborted the request (finish_reason abort)")
                if event.error is not None:
                    record.error, record.error_detail, record.end_time = "stream_error", event.error, now
                    return None
                if event.text:
                    record.chunk_times.append(now)
                    pieces.append(event.text)
                if event.usage is not None:
                    completion_tokens = event.usage.get("completion_tokens", completion_tokens)
                    record.prompt_tokens = event.usage.get("prompt_tokens", record.prompt_tokens)
        record.error, record.error_detail, record.end_time = (
            "connection_error",
            "the stream ended before [DONE]",
            clock(),
        )
        return None
