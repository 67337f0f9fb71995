"""The server's side of the engine core process: start it, feed it, and turn what it sends
into request streams for asyncio callers (the same face as `AsyncEngine`).

Processes and threads:
- The engine core process (`core_process.py`) runs the scheduler and executor loop, nothing else.
- One output thread here (started by `start()`) owns the frontend (detokenizers, stop strings,
  request metrics, stat loggers) and both sockets. It sleeps in one poll on the core's frames and
  a wake-up pipe; each turn it ships the commands the event loop queued as one frame, and turns
  each frame from the core (one per step) into outputs, delivered with one call per event loop.
- The event loop only queues commands (add / abort / stop) and writes a byte to the pipe.

An add is a round trip, as in `AsyncEngine`: bad input fails here (ValueError), a full queue
in the core (QueueFullError), both before any output. A stream that is closed early aborts its
request: its sequences are dropped here at once, and the core frees their KV blocks when the
abort arrives. A stop string is matched here, so the core learns of it one step late and may
run the sequence once more; that token is dropped.

If the core dies (its last frame says why, or the process is gone without one) every open
stream raises `EngineDeadError` with the reason, `is_healthy` turns false and `on_death` is
called: the server logs it and exits 1.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from moeserve.config import EngineConfig
from moeserve.distributed.launcher import exit_description
from moeserve.distributed.processes import start_process
from moeserve.engine.command_queue import AbortCommand, AddCommand, QueuedEngineClient, StopCommand
from moeserve.engine.core import SchedulerStats
from moeserve.engine.core_messages import (
    Abort,
    Add,
    CoreInputs,
    CoreOutputs,
    Finish,
    Shutdown,
    decode_outputs,
    encode_inputs,
    refusal,
)
from moeserve.engine.cpu_binding import CpuBinding
from moeserve.engine.engine import ModelFacts
from moeserve.engine.frontend import EngineFrontend
from moeserve.engine.stats import IterationStats, RequestMetrics, StatLogger
from moeserve.engine.streams import EngineDeadError, Stream, deliver_all
from moeserve.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the output thread looks at the core process when no frame comes
CORE_MODULE = "moeserve.engine.core_process"


class CoreProcess:
    """The engine core's process and the two sockets to it (bound here, on loopback)."""

    def __init__(self, config: EngineConfig, binding: CpuBinding | None = None) -> None:
        """binding: the CPUs the core may run on (and size its torch thread pool by), and the
        frontend's, where its socket thread goes; None: this process's, for all its threads."""
        self._context = zmq.Context()
        self.inputs = self._context.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.LINGER, 0)
        self.inputs.setsockopt(zmq.SNDHWM, 0)
        self.outputs = self._context.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        inputs_port = self.inputs.bind_to_random_port("tcp://127.0.0.1")
        outputs_port = self.outputs.bind_to_random_port("tcp://127.0.0.1")
        argv = [
            "--inputs",
            f"tcp://127.0.0.1:{inputs_port}",
            "--outputs",
            f"tcp://127.0.0.1:{outputs_port}",
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        ]
        if binding is not None:
            argv += ["--cpus", ",".join(map(str, binding.engine)), "--io-cpus", ",".join(map(str, binding.frontend))]
        # Forked from the forkserver, which imports the core's modules once for it and for the
        # grammar workers forked after it: the core no longer pays its own torch import.
        self.proc = start_process(CORE_MODULE, argv, stdin=pickle.dumps(config), preload=CORE_MODULE)
        logger.info("engine core process started (pid %d)", self.proc.pid)

    def exit_reason(self) -> str | None:
        """Why the process is gone, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"the engine core process (pid {self.proc.pid}) {exit_description(code)}"

    def receive(self, timeout_s: float) -> CoreOutputs | None:
        if self.outputs.poll(int(timeout_s * 1000)):
            return decode_outputs(self.outputs.recv(copy=False).buffer)
        return None

    def wait_ready(self) -> SchedulerStats:
        """Block until the core has loaded the model: its gauges, or RuntimeError with the reason."""
        while True:
            first = self.receive(POLL_S)
            if first is not None:
                if first.dead is not None:
                    raise RuntimeError(first.dead)
                return first.gauges
            reason = self.exit_reason()
            if reason is not None:
                raise RuntimeError(f"{reason} while loading the model")

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` s for the process to leave, then kill it; close the sockets."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core did not stop within %s s; killing it", timeout)
            self.proc.kill()
            self.proc.wait()
        self.inputs.close()
        self.outputs.close()
        self._context.term()


class EngineCoreClient(QueuedEngineClient):
    """The engine core in its own process, served to asyncio callers; see the module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: Sequence[StatLogger] = (),
        on_death: Callable[[BaseException], None] | None = None,
        binding: CpuBinding | None = None,
    ) -> None:
        """Reads the model's facts and tokenizer here; `start()` loads the model in the core, on
        `binding`'s CPUs if given (`cpu_binding`). on_death(error): called on the output thread if the core
        dies (not after `shutdown()`)."""
        super().__init__()
        self.config = config
        self._binding = binding
        self.facts = ModelFacts.read(config)
        self.max_model_len = self.facts.max_model_len
        self.frontend = EngineFrontend(
            load_tokenizer(config.model),
            self.facts.model_config.vocab_size,
            self.max_model_len,
            config.slo,
            stat_loggers,
        )
        self.num_kv_blocks = 0
        self._on_death = on_death
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._streams: dict[str, Stream] = {}  # output thread only
        self._pending: dict[str, concurrent.futures.Future[None]] = {}  # adds the core has not answered
        self._abort_metrics: list[RequestMetrics] = []  # published with the core's next gauges
        self._process: CoreProcess | None = None

    # ---- lifecycle (any thread) ------------------------------------------------------------

    def start(self) -> None:
        """Start the core process and block until it has loaded the model (RuntimeError if it
        cannot), then start the output thread."""
        if self._process is not None:
            raise RuntimeError("EngineCoreClient.start() was already called")
        self._process = CoreProcess(self.config, self._binding)
        try:
            self.num_kv_blocks = self._process.wait_ready().kv_blocks_total
        except BaseException:
            self._process.stop(timeout=10.0)
            raise
        self._thread = threading.Thread(target=self._run, name="moeserve-core-outputs", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.proc.pid

    @property
    def is_healthy(self) -> bool:
        """True while the core runs and the output thread serves it."""
        return self._thread is not None and self._thread.is_alive() and self._error is None and not self._closed

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort what is running, stop the core and wait up to `timeout` s for it."""
        if self._process is None:
            return
        try:
            self._submit(StopCommand())
        except EngineDeadError:
            pass  # already stopped or dead
        if self._thread is not None:
            self._thread.join(timeout)
        self._process.stop(timeout if timeout is not None else 10.0)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the thread will look

    # ---- the output thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a dead core must fail its streams, not hang them
            logger.error("the engine core stopped: %s; failing every open request", exc)
            self._error = exc
            self._close(EngineDeadError(f"the engine stopped: {exc}"))
            if self._on_death is not None:
                self._on_death(exc)

    def _loop(self) -> None:
        process = self._process
        poller = zmq.Poller()
        poller.register(process.outputs, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        stopping = False
        while True:
            events = dict(poller.poll(int(POLL_S * 1000)))
            if self._wake_read in events:
                try:
                    os.read(self._wake_read, 4096)
                except BlockingIOError:
                    pass
            inputs = CoreInputs()
            stopping = self._take_commands(inputs) or stopping
            while (frame := process.receive(0.0)) is not None:
                if frame.dead is not None:
                    raise RuntimeError(frame.dead)
                self._handle(frame, inputs)
                if frame.stopped:
                    return
            if inputs.commands:
                process.inputs.send(encode_inputs(inputs), copy=False)
            reason = process.exit_reason()
            if reason is not None:
                if stopping:
                    return
                raise RuntimeError(reason)

    def _take_commands(self, inputs: CoreInputs) -> bool:
        """Turn the queued commands into core commands; True once a stop is among them."""
        stop = False
        delivered = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, StopCommand):
                stop = True
                for stream in self._streams.values():
                    delivered.append((stream, None))
                self._streams.clear()
                inputs.commands.append(Shutdown())
                with self._lock:
                    self._closed = True
            elif isinstance(command, AbortCommand):
                owner = self._streams.get(command.request_id)
                if owner is not None and (command.stream is None or command.stream is owner):
                    del self._streams[command.request_id]
                    future = self._pending.pop(command.request_id, None)
                    if future is not None:  # aborted before the core answered: accepted, and over
                        future.set_result(None)
                    self._close_request(command.request_id, inputs)
                    delivered.append((owner, None))
            else:
                self._add(command, inputs)
        deliver_all(delivered)
        return stop

    def _add(self, command: AddCommand, inputs: CoreInputs) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the caller was cancelled before we got here: nothing to add
        try:
            text, token_ids, params = self.frontend.prepare(command.prompt, command.params)
            request_id, samples = self.frontend.open(text, token_ids, params, command.request_id, command.arrival_time)
        except Exception as exc:  # the caller's error to handle (bad input)
            command.accepted.set_exception(exc)
            return
        self._streams[request_id] = command.stream
        self._pending[request_id] = command.accepted
        inputs.commands.append(Add(request_id, samples))

    def _close_request(self, request_id: str, inputs: CoreInputs, judged: bool = True) -> None:
        """Forget a request here and have the core abort it; its metrics wait for fresh gauges.
        An unjudged one (refused by SLO admission, counted as a rejection) leaves no metrics."""
        closed = self.frontend.close(request_id, time.monotonic())
        if closed is not None:
            sequence_ids, metrics = closed
            inputs.commands.append(Abort(sequence_ids))
            if judged:
                self._abort_metrics.append(metrics)

    def _handle(self, frame: CoreOutputs, inputs: CoreInputs) -> None:
        """One frame from the core: answer adds, make the step's outputs, publish its stats."""
        for key in frame.accepted:
            if key in frame.best_effort:
                self.frontend.mark_best_effort(key, frame.best_effort[key])
            future = self._pending.pop(key, None)
            if future is not None:
                future.set_result(None)
        for key, kind, message in frame.refused:
            future = self._pending.pop(key, None)
            self._streams.pop(key, None)
            self._close_request(key, inputs, judged=kind != "SLORejectedError")
            if future is not None:
                future.set_exception(refusal(kind, message, frame.retry_after_s.get(key)))
        stats = IterationStats()
        if frame.step is not None:
            processed, stats = self.frontend.process(frame.step)
            if processed.stopped:
                inputs.commands.append(Finish(processed.stopped))
            delivered = []
            for output in processed.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                delivered.append((stream, output))
            deliver_all(delivered)
        stats.finished.extend(self._abort_metrics)
        self._abort_metrics.clear()
        self.frontend.publish(stats, frame.gauges)

    def _fail_streams(self, error: EngineDeadError) -> None:
        deliver_all([(stream, error) for stream in self._streams.values()])
        self._streams.clear()
        for future in self._pending.values():
            future.set_exception(error)
        self._pending.clear()
