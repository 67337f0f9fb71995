"""The pre-rendered SSE chunks are byte for byte what the pydantic chunk models write."""

from __future__ import annotations

import json

import pytest

from moeserve.api.chunks import ChatChunks, CompletionChunks
from moeserve.api.protocol import CompletionLogprobs, DeltaMessage, chat_chunk, completion_chunk, sse

# Quotes, backslashes, every control character, non-ASCII and astral characters, an empty text.
TEXTS = ["", " hello", 'say "hi"\\', "".join(map(chr, range(32))) + "\x7f", "héllo 世界 🤖", "\u2028\u2029"]
IDS = [("cmpl-1", "m"), ('id "q"', "módel/ü\n")]


@pytest.mark.parametrize("request_id,model", IDS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length", "abort"])
def test_completion_chunks_match_the_models(request_id: str, model: str, text: str, finish: str | None) -> None:
    chunks = CompletionChunks(request_id, model, 1700000000)
    assert chunks.event(3, text, finish) == sse(completion_chunk(request_id, model, 1700000000, 3, text, finish))


@pytest.mark.parametrize("request_id,model", IDS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop"])
def test_chat_chunks_match_the_models(request_id: str, model: str, text: str, finish: str | None) -> None:
    chunks = ChatChunks(request_id, model, 7)
    for role, content in [("assistant", text), (None, text), (None, None), ("assistant", None)]:
        expected = sse(chat_chunk(request_id, model, 7, 1, DeltaMessage(role=role, content=content), finish))
        assert chunks.event(1, content, finish, role=role) == expected
        delta = DeltaMessage(role=role, content=content, reasoning_content=text)
        assert chunks.event(1, content, finish, role=role, reasoning=text) == sse(
            chat_chunk(request_id, model, 7, 1, delta, finish)
        )


def test_chunks_with_logprobs_take_the_models() -> None:
    logprobs = CompletionLogprobs(tokens=["a"], token_logprobs=[-0.5], top_logprobs=[{"a": -0.5}], text_offset=[0])
    event = CompletionChunks("cmpl-1", "m", 7).event(0, "a", None, logprobs)
    assert event == sse(completion_chunk("cmpl-1", "m", 7, 0, "a", None, logprobs))
    assert json.loads(event[len("data: ") :])["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
