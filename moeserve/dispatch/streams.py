"""Streams and events: how communication is put beside compute instead of behind it.

On one CUDA stream every kernel waits for the one before it, so an all-to-all's kernels and the
experts' GEMMs take turns however they are interleaved on the host. A dispatcher with a comm
stream of its own enqueues its kernels there, and the two streams meet only at events: the comm
stream waits for an event recorded on the compute stream after the rows it sends were produced,
and the compute stream waits for an event recorded on the comm stream after the rows it reads
arrived. Between those events the GPU runs both, as DeepEP's hooks and SGLang's two-batch
overlap do.

One interface, two backends. `CudaStreams` is torch.cuda's streams and events. `CpuStreams` runs
every operation at once, in the host's order (a CPU has nothing to overlap), and can record what
was enqueued on which stream and which events ordered the streams, so a test can check on a CPU
that each cross-stream dependency is an event and that nothing else orders the streams.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch


class Streams(ABC):
    """A device's streams and events. Streams and events are the backend's own objects."""

    @abstractmethod
    def current(self) -> Any:
        """The stream the caller enqueues on now: for a dispatcher, the compute stream."""

    @abstractmethod
    def new_stream(self, name: str) -> Any:
        """A stream of its own, running beside the others (`name` says what it is for)."""

    @abstractmethod
    def on(self, stream: Any, what: str) -> contextlib.AbstractContextManager[None]:
        """A context whose work (`what`, a name for it) is enqueued on `stream`. Never keep one
        open across a yield: the caller's work would land on `stream` too."""

    @abstractmethod
    def record(self, stream: Any) -> Any:
        """An event that completes when everything enqueued on `stream` so far has."""

    @abstractmethod
    def wait(self, stream: Any, event: Any) -> None:
        """Work enqueued on `stream` from now on starts only once `event` has completed."""

    def follow(self, waiter: Any, producer: Any) -> None:
        """`waiter`'s later work runs after everything enqueued on `producer` so far."""
        self.wait(waiter, self.record(producer))


class CudaStreams(Streams):
    """torch.cuda streams and events on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def on(self, stream: torch.cuda.Stream, what: str) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)


@dataclass(frozen=True)
class CpuStream:
    name: str


@dataclass(frozen=True)
class CpuEvent:
    index: int
    stream: CpuStream


@dataclass(frozen=True)
class StreamOp:
    """One recorded operation: work enqueued on a stream, or an event recorded on or waited for by one.

    scope: the names of the `on` contexts it was enqueued inside, outermost first (two-batch
    overlap enqueues each micro-batch's turn inside one named for it)."""

    kind: Literal["enqueue", "record", "wait"]
    stream: str
    what: str
    scope: tuple[str, ...]
    event: int | None = None


@dataclass
class CpuStreams(Streams):
    """Work runs at once, in the host's order. With `recording`, `ops` keeps every operation,
    which `happens_before` reads as a GPU would order it: by stream order and events alone."""

    recording: bool = False
    ops: list[StreamOp] = field(default_factory=list)
    _current: CpuStream = field(default_factory=lambda: CpuStream("compute"))
    _scope: tuple[str, ...] = ()
    _events: int = 0

    def current(self) -> CpuStream:
        return self._current

    def new_stream(self, name: str) -> CpuStream:
        return CpuStream(name)

    @contextlib.contextmanager
    def on(self, stream: CpuStream, what: str) -> Iterator[None]:
        self._log("enqueue", stream, what)
        outer = self._current, self._scope
        self._current, self._scope = stream, (*self._scope, what)
        try:
            yield
        finally:
            self._current, self._scope = outer

    def note(self, what: str) -> None:
        """Name work about to be enqueued on the current stream: the recording's instrument for
        work that is no `on` context of its own (a test marks a model's router and experts so)."""
        self._log("enqueue", self._current, what)

    def record(self, stream: CpuStream) -> CpuEvent:
        event = CpuEvent(self._events, stream)
        self._events += 1
        self._log("record", stream, f"event {event.index}", event.index)
        return event

    def wait(self, stream: CpuStream, event: CpuEvent) -> None:
        self._log("wait", stream, f"event {event.index}", event.index)

    def happens_before(self, first: int, second: int) -> bool:
        """Whether op `first` must finish before op `second` starts on a GPU, by stream order and
        events alone: what a device would guarantee, not the host's order."""
        preceding: dict[int, list[int]] = {}
        last_on: dict[str, int] = {}
        recorded_at: dict[int, int] = {}
        for i, op in enumerate(self.ops[: second + 1]):
            preceding[i] = [last_on[op.stream]] if op.stream in last_on else []
            if op.kind == "wait" and op.event in recorded_at:
                preceding[i].append(recorded_at[op.event])
            if op.kind == "record":
                recorded_at[op.event] = i
            last_on[op.stream] = i
        reached, frontier = set(), [second]
        while frontier:
            for before in preceding[frontier.pop()]:
                if before == first:
                    return True
                if before not in reached:
                    reached.add(before)
                    frontier.append(before)
        return False

    def _log(self, kind: str, stream: CpuStream, what: str, event: int | None = None) -> None:
        if self.recording:
            self.ops.append(StreamOp(kind, stream.name, what, self._scope, event))  # type: ignore[arg-type]


def streams_for(device: torch.device) -> Streams:
    """The backend for `device`: CUDA's streams on a GPU, immediate work (unrecorded) elsewhere."""
    return CudaStreams(device) if device.type == "cuda" else CpuStreams()
