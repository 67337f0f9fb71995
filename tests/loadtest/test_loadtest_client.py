"""The streaming client against fake byte streams: SSE framing, what counts as a token, error types."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from loadtest_fakes import DONE, PROMPT, SETTINGS, FakeClock, completion_script, record, sse, text_chunk, usage_chunk

from moeserve.loadtest.client import (
    HTTPResponse,
    RequestSettings,
    SSEDecoder,
    parse_event,
    request_payload,
    send_request,
)
from moeserve.loadtest.datasets import Prompt


def test_sse_events_split_across_reads_and_packed_into_one():
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a"') == []
    assert decoder.feed(b": 1}\r\n\r\n: keep-alive comment\n\ndata: x\ndata: y\n\ndata: [DO") == ['{"a": 1}', "x\ny"]
    assert decoder.feed(b"NE]\n") == []
    assert decoder.feed(b"\n") == ["[DONE]"]
    assert decoder.feed("data: é\n\n".encode()[:7]) == []  # a character cut between reads
    assert decoder.feed("data: é\n\n".encode()[7:]) == ["é"]


def test_parse_event_reads_completion_chat_usage_and_errors():
    assert parse_event('{"choices": [{"text": "hi", "finish_reason": null}]}').text == "hi"
    assert parse_event('{"choices": [{"delta": {"role": "assistant", "content": ""}}]}').text == ""
    assert parse_event('{"choices": [{"delta": {"content": "yo"}, "finish_reason": "stop"}]}').finish_reason == "stop"
    assert parse_event('{"choices": [{"delta": {"reasoning_content": "hmm"}}]}').text == "hmm"
    assert parse_event('{"choices": [], "usage": {"completion_tokens": 5}}').usage == {"completion_tokens": 5}
    assert parse_event('{"error": {"message": "engine died", "code": 500}}').error == "engine died"
    assert parse_event("not json").error.startswith("malformed chunk")


def test_chat_role_chunk_is_not_the_first_token():
    clock = FakeClock()
    chat = RequestSettings("chat", "m", False, 60.0)
    script = [
        (0.0625, sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]})),
        (0.25, sse({"choices": [{"delta": {"content": "a"}}]})),
        (0.375, sse({"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]})),
        (0.5, sse({"choices": [{"delta": {}, "finish_reason": "stop"}]})),  # a bare finish chunk is no token either
        (0.5, usage_chunk(2)),
        (0.5, DONE),
    ]
    r = record(clock, 0.0, script, settings=chat, prompt=Prompt("hello", None, 2))
    assert (r.error, r.chunk_times, r.end_time, r.text, r.output_tokens) == (None, [0.25, 0.375], 0.5, "ab", 2)


def test_token_counts_come_from_usage_then_tokenizer_then_chunks():
    clock = FakeClock()
    with_usage = record(clock, 0.0, completion_script([0.125, 0.25], 7))
    assert (with_usage.output_tokens, with_usage.token_source, with_usage.prompt_tokens) == (7, "usage", 3)
    tokenized = record(clock, 0.0, completion_script([0.125, 0.25], None), count_tokens=lambda text: 10 * len(text))
    assert (tokenized.output_tokens, tokenized.token_source, tokenized.text) == (40, "tokenizer", "t0t1")
    counted = record(clock, 0.0, completion_script([0.125, 0.25], None), prompt=Prompt([1, 2], 2, 5))
    assert (counted.output_tokens, counted.token_source, counted.prompt_tokens) == (2, "chunks", 2)


@pytest.mark.parametrize(
    ("status", "script", "error", "detail"),
    [
        (429, [(0.1, b"queue full")], "http_4xx", "HTTP 429: queue full"),
        (500, [(0.1, b"")], "http_5xx", "HTTP 500"),
        (
            200,
            [(0.125, text_chunk("a")), (0.25, sse({"error": {"message": "boom"}})), (0.25, DONE)],
            "stream_error",
            "boom",
        ),
        (200, [(0.125, text_chunk("a")), (0.25, text_chunk("", "abort")), (0.25, DONE)], "stream_error", "aborted"),
        (200, [(0.125, text_chunk("a"))], "connection_error", "before [DONE]"),
        (200, [(0.125, usage_chunk(0)), (0.125, DONE)], "empty_output", "without any content"),
    ],
    ids=["4xx", "5xx", "error-event", "abort", "cut-stream", "empty"],
)
def test_error_types(status, script, error, detail):
    clock = FakeClock()
    r = record(clock, 0.0, script, status=status)
    assert r.error == error and detail in r.error_detail
    assert r.end_time == script[-1][0]


def test_connection_refused_is_a_connection_error():
    @asynccontextmanager
    async def refuse(path: str, payload: dict[str, Any]) -> AsyncIterator[HTTPResponse]:
        raise ConnectionRefusedError("nobody listens")
        yield  # pragma: no cover - makes this an async generator

    r = asyncio.run(send_request(refuse, SETTINGS, 0, PROMPT))
    assert r.error == "connection_error" and "ConnectionRefusedError" in r.error_detail


def test_timeout_cancels_and_keeps_what_arrived():
    clock = FakeClock()

    @asynccontextmanager
    async def stall(path: str, payload: dict[str, Any]) -> AsyncIterator[HTTPResponse]:
        async def body() -> AsyncIterator[bytes]:
            clock.now = 0.125
            yield text_chunk("a")
            await asyncio.sleep(30)
            yield DONE  # pragma: no cover

        yield HTTPResponse(200, body())

    settings = RequestSettings("completions", "m", False, timeout_s=0.05)
    r = asyncio.run(send_request(stall, settings, 0, PROMPT, clock=clock))
    assert r.error == "timeout" and "0.05 s" in r.error_detail
    assert r.chunk_times == [0.125]


def test_request_payloads():
    path, body = request_payload(SETTINGS, PROMPT)
    assert path == "/v1/completions"
    assert body == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": [11, 12, 13],
        "max_tokens": 8,
    }
    chat = RequestSettings("chat", "m", True, 60.0)
    path, body = request_payload(chat, Prompt("hi", None, 4))
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert (body["max_completion_tokens"], body["ignore_eos"]) == (4, True)
