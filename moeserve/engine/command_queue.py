"""The event-loop face both async engines share: requests become commands on a queue that one
thread (the one owning the engine, or the one talking to the core process) drains.

`AsyncEngine` and `EngineCoreClient` differ in what drains the queue, not in how callers submit,
stream, abort or are refused once the engine is gone; that part lives here once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from moeserve.engine.frontend import Prompt
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.streams import EngineDeadError, RequestStream, Stream
from moeserve.sampling_params import SamplingParams


@dataclass
class AddCommand:
    prompt: Prompt
    params: SamplingParams
    request_id: str
    arrival_time: float  # when the caller asked, so TTFT includes the wait for the draining thread
    stream: Stream
    accepted: concurrent.futures.Future[None]


@dataclass
class AbortCommand:
    request_id: str
    stream: Stream | None  # set: abort only if this stream still owns the id (a failed add owns nothing)


class StopCommand:
    pass


class QueuedEngineClient(ABC):
    """Submission, streaming and abort for asyncio callers over a command queue.

    Subclasses start `_thread`, drain `_commands` on it, and call `_close(error)` there when the
    engine stops; `_wake()` is their hook to rouse that thread after a command is queued, and
    `_fail_streams(error)` ends their open streams.
    """

    def __init__(self) -> None:
        self._commands: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "closed" against submissions, so none is stranded
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    async def submit(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request and return its stream once the engine has accepted it.

        Raises what the engine's add raises (ValueError for bad input, QueueFullError) and
        EngineDeadError, so a server can answer 400 / 429 / 503 before it starts a response.
        Close the stream (`aclose()`, or `contextlib.aclosing`) when done: an unfinished one is
        aborted.
        """
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        stream = Stream(asyncio.get_running_loop())
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(AddCommand(prompt, params, request_id, time.monotonic(), stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            self._abort_quietly(AbortCommand(request_id, stream))  # a cancelled wait may still have been added
            raise
        return RequestStream(request_id, stream, lambda: self._abort_quietly(AbortCommand(request_id, stream)))

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as they are made; the last is finished.

        `submit` and iteration in one: errors of `submit` are raised at the first iteration.
        Leaving the loop early aborts the request; call `aclose()` (or use `contextlib.aclosing`)
        to abort it at once rather than when the generator is collected.
        """
        stream = await self.submit(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its stream ends without a finished output. Unknown ids are ignored."""
        self._submit(AbortCommand(request_id, None))

    def _submit(self, command: object) -> None:
        with self._lock:
            if self._closed or self._thread is None:
                raise EngineDeadError("the engine is not running") from self._error
            self._commands.put(command)
        self._wake()

    def _wake(self) -> None:  # noqa: B027 - a thread that blocks on the queue needs no wake-up
        """Rouse the draining thread; a thread that blocks on the queue itself needs nothing."""

    def _abort_quietly(self, command: AbortCommand) -> None:
        """Cleanup on a stream's exit; a stopped engine has nothing left to abort."""
        try:
            self._submit(command)
        except EngineDeadError:
            pass

    def _close(self, error: EngineDeadError) -> None:
        """Refuse new commands, then fail every open stream and queued add with `error`."""
        with self._lock:
            self._closed = True
        self._fail_streams(error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddCommand) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)

    @abstractmethod
    def _fail_streams(self, error: EngineDeadError) -> None:
        """End every open stream with `error` (on the draining thread)."""
