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

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.engine.command_queue import AbortCommand, AddCommand, QueuedEngineClient, StopCommand
from moeserve.engine.engine import LLMEngine
from moeserve.engine.streams import EngineDeadError, RequestStream, Stream, deliver_all

__all__ = ["AsyncEngine", "EngineDeadError", "RequestStream"]

logger = logging.getLogger(__name__)

StepListener = Callable[[float, int], None]
"""on_step(duration_s, num_outputs), called on the engine thread after every step."""


@dataclass
class _Lost:
    reason: str  # the executor lost a rank: nothing more can be stepped


_Command = AddCommand | AbortCommand | StopCommand | _Lost


class AsyncEngine(QueuedEngineClient):
    """Serve an `LLMEngine` to asyncio callers; see the module docstring for the threading contract."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: StepListener | None = None,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        """on_death(error): called on the engine thread if it dies (not after `shutdown()`),
        once every open stream has been failed: a server exits then."""
        super().__init__()
        self.engine = engine
        self._on_step = on_step
        self._on_death = on_death
        self._streams: dict[str, Stream] = {}  # engine thread only
        self._lost_reason: str | None = None

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
            self._submit(StopCommand())
        except EngineDeadError:
            pass  # already stopped or dead
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %s s", timeout)
        self.engine.shutdown()

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
                if isinstance(command, StopCommand):
                    self._abort_all()
                    self._close(EngineDeadError("the engine was shut down"))
                    return
                if isinstance(command, _Lost):
                    raise EngineDeadError(command.reason)
                self._handle(command)
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, command: AddCommand | AbortCommand) -> None:
        if isinstance(command, AbortCommand):
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

    def _fail_streams(self, error: EngineDeadError) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
