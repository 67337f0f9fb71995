"""The whole engine in a thread of this process, served to asyncio callers.

The server runs the engine core in its own process instead (`core_client.EngineCoreClient`, the
same face); this in-process form is for embedding the engine in an asyncio program, and for tests
that reach into the engine (its scheduler, a patched step) while it serves.

Threading contract:
- One daemon thread (started by `AsyncEngine.start()`) owns the `LLMEngine`; nothing else touches
  it, so the model needs no locks. The event loop only enqueues commands (add / abort / stop) on a
  thread-safe queue, which the engine thread drains between steps; with no work it blocks on it.
- Outputs go back to the caller's event loop with `loop.call_soon_threadsafe` into one
  `asyncio.Queue` per request, one call per loop per step (`streams.py`), so no engine work
  ever runs on the loop thread.
- An add is a round trip: `submit` awaits a future the engine thread resolves, so `add_request`'s
  ValueError / QueueFullError reach the caller before any output (a server answers 400 / 429
  before it starts a response); it returns the request's `RequestStream`.
- A stream whose consumer goes away (break, cancel, disconnect) aborts its request; its KV blocks
  are freed at the engine's next loop turn. A stream aborted by `abort()` or `shutdown()` ends
  without a finished output. If the engine thread dies, every open stream raises `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from moeserve.engine.engine import LLMEngine
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.streams import EngineDeadError, RequestStream, Stream, deliver_all
from moeserve.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]

logger = logging.getLogger(__name__)

StepListener = Callable[[float, int], None]
"""on_step(duration_s, num_outputs), called on the engine thread after every step."""


@dataclass
class _Add:
    prompt: str | dict | list[int]
    params: SamplingParams
    request_id: str
    arrival_time: float  # when the caller asked, so TTFT includes the wait for the engine thread
    stream: Stream
    accepted: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str
    stream: Stream | None  # set: abort only if this stream still owns the id (a failed add owns nothing)


class _Stop:
    pass


@dataclass
class _Lost:
    reason: str  # the executor lost a rank: nothing more can be stepped


_Command = _Add | _Abort | _Stop | _Lost


class AsyncEngine:
    """Serve an `LLMEngine` to asyncio callers; see the module docstring for the threading contract."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: StepListener | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """on_death(error): called on the engine thread if it dies (not after `shutdown()`),
        once every open stream has been failed: a server exits then."""
        self.engine = engine
        self._on_step = on_step
        self._on_death = on_death
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # orders "closed" against submissions, so none is stranded
        self._closed = False
        self._error: BaseException | None = None
        self._lost_reason: str | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle (any thread) ------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._thread = threading.Thread(target=self._run, name="moeserve-engine", daemon=True)
        self._thread.start()
        self.engine.add_failure_listener(self._lost)

    def _lost(self, reason: str) -> None:
        """From the executor's monitor thread: unhealthy now, and wake an idle engine thread so
        it dies and fails every stream (a busy one fails out of its step by itself)."""
        self._lost_reason = reason
        self._commands.put(_Lost(reason))

    @property
    def is_healthy(self) -> bool:
        """True while the engine thread runs; False once it died, stopped, lost a rank, or if never started."""
        return (
            self._thread is not None and self._thread.is_alive() and self._error is None and self._lost_reason is None
        )

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort what is running, stop the engine thread and wait up to `timeout` s for it."""
        if self._thread is None:
            return
        try:
            self._submit(_Stop())
        except EngineDeadError:
            pass  # already stopped or dead
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %s s", timeout)
        self.engine.shutdown()

    # ---- requests (event loop) -------------------------------------------------------------

    async def submit(
        self, prompt: str | dict | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request and return its stream once the engine has accepted it.

        Raises what `LLMEngine.add_request` raises (ValueError, QueueFullError) and EngineDeadError,
        so a server can answer 400 / 429 / 503 before it starts a response. Close the stream
        (`aclose()`, or `contextlib.aclosing`) when done with it: an unfinished one is aborted.
        """
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        stream = Stream(asyncio.get_running_loop())
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(prompt, params, request_id, time.monotonic(), stream, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except BaseException:
            self._abort_quietly(_Abort(request_id, stream))  # a cancelled wait may still have been added
            raise
        return RequestStream(request_id, stream, lambda: self._abort_quietly(_Abort(request_id, stream)))

    async def generate(
        self, prompt: str | dict | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as the engine makes them; the last is finished.

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
        self._submit(_Abort(request_id, None))

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._closed or self._thread is None:
                raise EngineDeadError("the engine is not running") from self._error
            self._commands.put(command)

    def _abort_quietly(self, command: _Abort) -> None:
        """Cleanup on a stream's exit; a stopped engine has nothing left to abort."""
        try:
            self._submit(command)
        except EngineDeadError:
            pass

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a dead engine must fail its streams, not hang them
            if self._lost_reason is not None:
                logger.error("engine stopped: %s; failing every open request", self._lost_reason)
            else:
                logger.exception("engine thread died; failing every open request")
            self._error = exc
            self._close(EngineDeadError(f"the engine stopped: {self._lost_reason or repr(exc)}"))
            if self._on_death is not None:
                self._on_death(exc)

    def _loop(self) -> None:
        """Drain commands between steps; block on the queue only when there is nothing to step."""
        while True:
            block = not self.engine.has_unfinished_requests()
            while True:
                try:
                    command = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if isinstance(command, _Stop):
                    self._abort_all()
                    self._close(EngineDeadError("the engine was shut down"))
                    return
                if isinstance(command, _Lost):
                    raise EngineDeadError(command.reason)
                self._handle(command)
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            owner = self._streams.get(command.request_id)
            if owner is not None and (command.stream is None or command.stream is owner):
                self.engine.abort_request(command.request_id)
                del self._streams[command.request_id]
                owner.put(None)
            return
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller was cancelled before we got here: nothing to add
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id, command.arrival_time)
        except Exception as exc:  # the caller's error to handle (bad input, queue full)
            command.accepted.set_exception(exc)
            return
        self._streams[command.request_id] = command.stream
        command.accepted.set_result(None)

    def _step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        duration = time.perf_counter() - started
        delivered = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            delivered.append((stream, output))
        deliver_all(delivered)
        if self._on_step is not None:
            try:
                self._on_step(duration, len(outputs))
            except Exception:
                logger.exception("on_step listener failed; the engine keeps serving")

    def _abort_all(self) -> None:
        for request_id, stream in self._streams.items():
            self.engine.abort_request(request_id)
            stream.put(None)
        self._streams.clear()

    def _close(self, error: EngineDeadError) -> None:
        """Refuse new commands, then fail every stream and pending add with `error`."""
        with self._lock:
            self._closed = True
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(error)
