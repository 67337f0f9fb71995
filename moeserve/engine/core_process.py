"""The engine core process: the scheduler and executor loop, alone in its interpreter.

    python -m moeserve.engine.core_process --inputs ADDR --outputs ADDR --parent-pid PID

Started by the server (`core_client.py`, forked from its forkserver where it can be, see
`distributed.processes`), which binds both sockets and writes the pickled `EngineConfig` to this
process's stdin. Here the loop owns the CPU between steps: no HTTP, no tokenizer, no event loop
competes with it for the GIL. Each turn it reads every command frame
that has arrived, runs one step if anything is unfinished, and sends one frame with the step's
outputs and the answers to those commands; when new requests were among them, their answer
goes first, in its own frame, so a client hears it was admitted without waiting for a step.

The first frame says the model is loaded (its gauges give the KV cache size) or why it is not.
Any failure later (a step raising, a lost rank) is sent as the last frame's `dead` reason and
the process exits 1; the server fails its requests and exits too. If the server process is gone
the core exits, and its rank processes, which watch it, follow. Signals are the server's to act
on: the core ignores SIGINT and SIGTERM, so a drain is never cut short by a signal to the group.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Iterable

import torch
import zmq

from moeserve.config import EngineConfig
from moeserve.distributed.processes import started_by
from moeserve.engine.core import EngineCore, SchedulerStats
from moeserve.engine.core_messages import (
    Abort,
    Add,
    CoreOutputs,
    Finish,
    Shutdown,
    decode_inputs,
    encode_outputs,
)
from moeserve.engine.cpu_binding import bind_current_process
from moeserve.scheduler import SLORejectedError

logger = logging.getLogger("moeserve.engine.core")

IDLE_POLL_S = 0.1  # how often an idle core looks up: a lost rank or a dead server is seen this fast
PARENT_CHECK_S = 0.1  # at most this often the loop asks whether the server is there (a /proc read
# when the core was forked from the server's forkserver, which outlives the server while the
# core holds it open)


_NO_GAUGES = SchedulerStats(0, 0, 0, 0)  # in frames sent when there is no scheduler (yet, or any more)


class CoreChannel:
    """The core's ends of the two sockets the server bound: frames in, frames out."""

    def __init__(self, inputs_address: str, outputs_address: str, io_cpus: Iterable[int] = ()) -> None:
        """io_cpus: where zmq's threads (socket I/O, reaper) run; the process's CPUs if empty. The
        server gives them the frontend's CPU, so that moving each step's frame to the socket
        never preempts the step on the core's own CPU."""
        self._context = zmq.Context()
        for cpu in io_cpus:
            self._context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)  # before the first socket starts them
        self._inputs = self._context.socket(zmq.PULL)
        self._inputs.setsockopt(zmq.LINGER, 0)
        self._inputs.setsockopt(zmq.RCVHWM, 0)
        self._inputs.connect(inputs_address)
        self._outputs = self._context.socket(zmq.PUSH)
        self._outputs.setsockopt(zmq.LINGER, 5000)  # the last frame (why the core stops) must arrive
        self._outputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.connect(outputs_address)

    def receive_all(self, timeout_s: float) -> list[bytes]:
        """Every frame that has arrived, waiting up to `timeout_s` for the first."""
        if not self._inputs.poll(int(timeout_s * 1000)):
            return []
        frames = []
        while True:
            try:
                frames.append(self._inputs.recv(zmq.NOBLOCK, copy=True))
            except zmq.Again:
                return frames

    def send(self, outputs: CoreOutputs) -> None:
        self._outputs.send(encode_outputs(outputs), copy=False)

    def close(self) -> None:
        self._inputs.close()
        self._outputs.close()
        self._context.term()


class CoreLoop:
    """Reads commands, steps, answers; `run()` returns the exit code."""

    def __init__(self, core: EngineCore, channel: CoreChannel, parent_pid: int) -> None:
        self.core, self.channel, self.parent_pid = core, channel, parent_pid
        self._parent_checked = -PARENT_CHECK_S
        self._lost: str | None = None
        core.add_failure_listener(self._on_lost)

    def _on_lost(self, reason: str) -> None:
        """From the executor's monitor thread: the loop sees it within `IDLE_POLL_S`, or its step
        raises by itself."""
        self._lost = reason

    def run(self) -> int:
        while True:
            now = time.monotonic()
            if now >= self._parent_checked + PARENT_CHECK_S:
                if not started_by(self.parent_pid):
                    logger.error("the server process is gone; the engine core exits")
                    return 1
                self._parent_checked = now
            if self._lost is not None:
                raise RuntimeError(self._lost)
            busy = self.core.has_unfinished_requests()
            frames = self.channel.receive_all(0.0 if busy else IDLE_POLL_S)
            out = CoreOutputs(gauges=_NO_GAUGES)
            for frame in frames:
                if self._apply(frame, out):
                    out.gauges, out.stopped = self.core.scheduler_stats(), True
                    self.channel.send(out)
                    return 0
            if out.accepted or out.refused:  # callers wait on these: answer before the step, not after it
                out.gauges = self.core.scheduler_stats()
                self.channel.send(out)
                out = CoreOutputs(gauges=_NO_GAUGES)
            elif frames:
                out.gauges = self.core.scheduler_stats()  # aborts and finishes ride with the step, if any
            if self.core.has_unfinished_requests():
                out.step = self.core.step()
                out.gauges = out.step.scheduler
            if out.step is not None or out.gauges is not _NO_GAUGES:
                self.channel.send(out)

    def _apply(self, frame: bytes, out: CoreOutputs) -> bool:
        """Apply one frame's commands in order; True once a Shutdown is read."""
        for command in decode_inputs(frame).commands:
            if isinstance(command, Add):
                try:
                    predicted_ttft_s = self.core.add_requests(command.samples)
                except (ValueError, RuntimeError) as exc:  # a full queue, or a request the scheduler refuses
                    out.refused.append((command.key, type(exc).__name__, str(exc)))
                    if isinstance(exc, SLORejectedError):
                        out.retry_after_s[command.key] = exc.retry_after_s
                else:
                    out.accepted.append(command.key)
                    if predicted_ttft_s is not None:
                        out.best_effort[command.key] = predicted_ttft_s
            elif isinstance(command, Abort):
                self.core.abort_requests(command.sequence_ids)
            elif isinstance(command, Finish):
                self.core.finish_requests(command.stops)
            elif isinstance(command, Shutdown):
                return True
        return False


def serve_core(config: EngineConfig, channel: CoreChannel, parent_pid: int) -> int:
    """Load, announce, loop; the exit code. Every failure is sent to the server before it returns."""
    from moeserve.engine.engine import ModelFacts

    try:
        facts = ModelFacts.read(config)
        core = EngineCore(config, facts.model_config, facts.dtype, facts.max_model_len, facts.eos_token_ids)
    except Exception as exc:  # noqa: BLE001 - the server logs the reason and exits
        logger.debug("load failed", exc_info=True)
        channel.send(CoreOutputs(gauges=_NO_GAUGES, dead=f"could not load the model: {_describe(exc)}"))
        return 1
    channel.send(CoreOutputs(gauges=core.scheduler_stats()))
    loop = CoreLoop(core, channel, parent_pid)
    try:
        return loop.run()
    except BaseException as exc:  # noqa: BLE001 - a dead core must say why before it goes
        reason = loop._lost or _describe(exc)
        if loop._lost is None:
            logger.exception("the engine core failed")
        channel.send(CoreOutputs(gauges=_NO_GAUGES, dead=reason))
        return 1
    finally:
        core.shutdown()


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _ignore(_signum: int, _frame: object) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moeserve-engine-core", description="the engine core (started by the server)")
    parser.add_argument("--inputs", required=True, help="address of the server's command socket")
    parser.add_argument("--outputs", required=True, help="address of the server's output socket")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process is gone")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--cpus", help="comma-separated CPUs to run on (the server's cpu_binding); default: inherited")
    parser.add_argument("--io-cpus", help="comma-separated CPUs for zmq's socket threads; default: those of --cpus")
    args = parser.parse_args(argv)
    if args.cpus:
        bind_current_process(int(cpu) for cpu in args.cpus.split(","))  # before any torch thread exists
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Ctrl-C, or a service manager's SIGTERM, may reach the whole process group: the server
    # drains its requests first and then says stop (or is gone, which the loop notices).
    # Handlers rather than SIG_IGN: an ignored signal stays ignored in the rank processes this
    # one starts, and those must still stop on SIGTERM.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    config: EngineConfig = pickle.load(sys.stdin.buffer)
    if config.device.startswith("cpu"):
        # One torch thread per CPU this process may use: the server may have bound it to fewer
        # than the machine has (`cpu_binding`), and more threads than CPUs only contend.
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    io_cpus = [int(cpu) for cpu in args.io_cpus.split(",")] if args.io_cpus else []
    channel = CoreChannel(args.inputs, args.outputs, io_cpus)
    try:
        code = serve_core(config, channel, args.parent_pid)
    finally:
        channel.close()
    logging.shutdown()
    return code


if __name__ == "__main__":
    # Everything is stopped, sent and flushed by now: skip the interpreter's teardown, which
    # (torch's and zmq's native state, a KV transfer agent's threads) took 0.6-0.9 s of an idle
    # server's stop and, on a busy machine, long enough for the server to kill the core.
    # The rank processes end the same way (`distributed/worker.py`).
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
