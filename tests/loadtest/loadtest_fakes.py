"""A fake clock and a fake streaming server for the load-test harness: exact timings, no network."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from moeserve.loadtest.client import HTTPResponse, Opener, RequestRecord, RequestSettings, send_request
from moeserve.loadtest.datasets import Prompt

SETTINGS = RequestSettings(endpoint="completions", model="m", ignore_eos=False, timeout_s=60.0)
PROMPT = Prompt([11, 12, 13], 3, 8)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_chunk(text: str, finish_reason: str | None = None) -> bytes:
    return sse({"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]})


def usage_chunk(completion_tokens: int, prompt_tokens: int = 3) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}})


DONE = b"data: [DONE]\n\n"


def opener(clock: FakeClock, script: Sequence[tuple[float, bytes]], status: int = 200) -> Opener:
    """A server whose response arrives as `script`: the clock reads t when piece b arrives."""

    @asynccontextmanager
    async def open_stream(path: str, payload: dict[str, Any]) -> AsyncIterator[HTTPResponse]:
        async def body() -> AsyncIterator[bytes]:
            for t, piece in script:
                clock.now = t
                yield piece

        yield HTTPResponse(status, body())

    return open_stream


def completion_script(chunk_times: Sequence[float], completion_tokens: int | None) -> list[tuple[float, bytes]]:
    """A streamed completion: one text chunk per time, the last with finish_reason, then usage
    (when given) and [DONE] at the last chunk's time."""
    script = [
        (t, text_chunk(f"t{i}", "length" if i == len(chunk_times) - 1 else None)) for i, t in enumerate(chunk_times)
    ]
    end = chunk_times[-1]
    if completion_tokens is not None:
        script.append((end, usage_chunk(completion_tokens)))
    script.append((end, DONE))
    return script


def record(
    clock: FakeClock,
    send_time: float,
    script: Sequence[tuple[float, bytes]],
    status: int = 200,
    index: int = 0,
    **kwargs: Any,
) -> RequestRecord:
    """Send one request at `send_time` to a server answering `script`."""
    clock.now = send_time
    return asyncio.run(
        send_request(
            opener(clock, script, status),
            kwargs.pop("settings", SETTINGS),
            index,
            kwargs.pop("prompt", PROMPT),
            clock=clock,
            **kwargs,
        )
    )
