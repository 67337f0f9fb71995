"""Request streams: one request's outputs, handed from the thread that makes them to the
caller's event loop.

Shared by both async engines (`AsyncEngine`: the engine in a thread of this process;
`EngineCoreClient`: the engine core in its own process, outputs processed in a thread here).
Outputs go to the loop with `loop.call_soon_threadsafe`, one call per loop per step rather than
one per request: each call wakes the loop (a pipe write and a GIL handoff), which with 64
streams cost a measurable share of every step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from moeserve.engine.outputs import RequestOutput
from moeserve.sampling_params import SamplingParams

# What a stream's queue carries: an output, the error that killed the engine, or None (aborted).
Item = RequestOutput | BaseException | None


class EngineDeadError(RuntimeError):
    """The engine is not running (died, shut down or never started): nothing will be served."""


class Stream:
    """One request's items on its caller's event loop.

    A deque and at most one waiting future rather than an `asyncio.Queue`: a stream has one
    reader, and this hand-off runs once per stream per step, so the queue's generality (many
    getters, maxsize, join) is paid 64 times a step for nothing.
    """

    __slots__ = ("loop", "_items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        """Called off the loop; a caller whose loop has closed is gone, so drop the item."""
        deliver_threadsafe(self.loop, [(self, item)])

    def push(self, item: Item) -> None:
        """Called on the loop: queue `item` and wake the reader."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Item:
        """The oldest item, waiting for one if there is none."""
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def latest(self, item: Item) -> Item:
        """`item`, or a later output already queued behind it: outputs are cumulative, so a slow
        reader skips to the newest, stopping at a finished output, an error or an abort."""
        items = self._items
        while items and isinstance(item, RequestOutput) and not item.finished:
            item = items.popleft()
        return item


def _deliver(batch: list[tuple[Stream, Item]]) -> None:
    for stream, item in batch:
        stream.push(item)


def deliver_threadsafe(loop: asyncio.AbstractEventLoop, batch: list[tuple[Stream, Item]]) -> None:
    """Hand `batch` to `loop` in one wake-up; a loop that has closed has no callers left: drop it."""
    try:
        loop.call_soon_threadsafe(_deliver, batch)
    except RuntimeError:
        pass


def deliver_all(items: list[tuple[Stream, Item]]) -> None:
    """Hand each item to its stream's loop, one wake-up per loop."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Item]]] = {}
    for stream, item in items:
        batches.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in batches.items():
        deliver_threadsafe(loop, batch)


class RequestStream:
    """One accepted request's outputs: an async iterator of cumulative `RequestOutput`s.

    Ends after the finished output, or without one if the request was aborted; raises
    EngineDeadError if the engine dies meanwhile. `aclose()` aborts it if it has not ended
    (`on_close` asks the engine to).
    """

    def __init__(self, request_id: str, stream: Stream, on_close: Callable[[], None]) -> None:
        self.request_id = request_id
        self._stream = stream
        self._on_close = on_close
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        item = self._stream.latest(await self._stream.get())
        if item is None or isinstance(item, BaseException) or item.finished:
            self._ended = True
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            self._on_close()


class EngineClient(Protocol):
    """What the HTTP layer needs of an engine: `EngineCoreClient` (the core in its own process,
    what the server runs) or `AsyncEngine` (the engine in a thread of this process)."""

    @property
    def is_healthy(self) -> bool: ...

    async def submit(
        self, prompt: str | dict | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream: ...

    async def abort(self, request_id: str) -> None: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...
