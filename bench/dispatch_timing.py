"""Timing half of `bench/dispatch.py`: clocks, the timed lockstep, and what a mode's run measures.

Emulated PEs share one stream, and one Python thread launches every PE's kernels: at 128 tokens a
PE's kernels take microseconds and their launches take longer, so plain CUDA events would time
the launches. `CudaClock` keeps the device busy instead: before a timed segment, if the device
has caught up with the host (its last event has completed, or the last segment ran dry), it
enqueues a sleep kernel long enough for the host to queue what follows, and the segment's events
then measure device time alone. A segment whose start event had already completed by the time
its end was queued may hold idle gaps: it is flagged `starved`, and a repeat with starved
segments (other than the high-throughput dispatch's host read, which drains the device by
design) is measured again with a longer sleep. `WallClock` runs the same code on CPU (smoke).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from dispatch_check import HIGH_THROUGHPUT, LOW_LATENCY

from moeserve.dispatch.symmetric import run_lockstep

MAX_SLEEP_US = 2e6

# Steps of one PE's dispatch_steps/combine_steps, grouped into phases: (first step, end) in the
# order the generators yield. High-throughput dispatch: step 0 sends the counts, step 1 reads
# everyone's to the host, plans and sends chunk 0, the rest receive chunk j and send chunk j + 1.
PHASES = {
    ("dispatch", LOW_LATENCY): {"send": (0, 1), "receive": (1, None)},
    ("dispatch", HIGH_THROUGHPUT): {"notify_and_first_send": (0, 2), "stream": (2, None)},
    ("combine", LOW_LATENCY): {"send": (0, 1), "receive": (1, None)},
    ("combine", HIGH_THROUGHPUT): {"stream": (0, None)},
}
HOST_READ_STEPS = {("dispatch", HIGH_THROUGHPUT): {1}}  # steps that drain the device on purpose


@dataclass
class Segment:
    start: Any
    end: Any
    starved: bool = False


class WallClock:
    """CPU (smoke): wall time around each segment; nothing runs behind the host's back."""

    name = "wall clock"

    def begin(self, keep_ahead: bool = True) -> float:
        return time.perf_counter()

    def end(self, start: float) -> Segment:
        return Segment(start, time.perf_counter())

    def concurrent(self, parts: Sequence[Callable[[], object]]) -> Segment:
        start = self.begin()
        for part in parts:
            part()
        return self.end(start)

    def us(self, segment: Segment) -> float:
        return (segment.end - segment.start) * 1e6

    def settle(self) -> None:
        pass

    def ensure_sleep(self, seconds: float) -> None:
        pass

    def grow(self) -> None:
        pass


class CudaClock:
    """CUDA events around segments, the device kept ahead of the host by sleep kernels (see the module doc)."""

    name = "CUDA events, device kept ahead of the host"

    def __init__(self) -> None:
        torch.cuda._sleep(1000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        self.cycles_per_us = 1e7 / (a.elapsed_time(b) * 1e3)
        self.sleep_us = 20_000.0
        self._last: torch.cuda.Event | None = None
        self._ran_dry = True
        self._streams: list[torch.cuda.Stream] = []

    def _record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def begin(self, keep_ahead: bool = True) -> torch.cuda.Event:
        """keep_ahead=False: the segment reads the device from the host, which waits for any sleep."""
        if keep_ahead and (self._ran_dry or self._last is None or self._last.query()):
            torch.cuda._sleep(int(self.sleep_us * self.cycles_per_us))
        return self._record()

    def end(self, start: torch.cuda.Event) -> Segment:
        self._last = self._record()
        self._ran_dry = start.query()  # the device reached the start before the host had queued the rest
        return Segment(start, self._last, self._ran_dry)

    def concurrent(self, parts: Sequence[Callable[[], object]]) -> Segment:
        """parts on streams of their own, all starting together; the segment ends when all have."""
        while len(self._streams) < len(parts):
            self._streams.append(torch.cuda.Stream())
        start, main = self.begin(), torch.cuda.current_stream()
        ends = []
        for part, stream in zip(parts, self._streams):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                part()
            ends.append(self._record(stream))
        for event in ends:
            main.wait_event(event)
        return self.end(start)

    def us(self, segment: Segment) -> float:
        return segment.start.elapsed_time(segment.end) * 1e3

    def settle(self) -> None:
        torch.cuda.synchronize()
        self._ran_dry = True

    def ensure_sleep(self, seconds: float) -> None:
        self.sleep_us = min(MAX_SLEEP_US, max(self.sleep_us, seconds * 1e6))

    def grow(self) -> None:
        self.sleep_us = min(MAX_SLEEP_US, self.sleep_us * 2)


Clock = WallClock | CudaClock


def timed_lockstep(
    steps: Sequence[Generator[None, None, Any]], clock: Clock, host_reads: Collection[int] = ()
) -> tuple[list[Any], list[list[Segment]], float]:
    """`run_lockstep` with every step of every PE a timed segment: the PEs' results, their
    segments in step order, and the host's wall time for the whole. Steps in `host_reads` read
    the device: no sleep before them, which the read would only wait out."""
    results: list[Any] = [None] * len(steps)
    segments: list[list[Segment]] = [[] for _ in steps]
    running = dict(enumerate(steps))
    started = time.perf_counter()
    while running:
        for rank, gen in list(running.items()):
            mark = clock.begin(keep_ahead=len(segments[rank]) not in host_reads)
            try:
                next(gen)
            except StopIteration as done:
                results[rank] = done.value
                del running[rank]
            segments[rank].append(clock.end(mark))
    return results, segments, time.perf_counter() - started


def phase_us(clock: Clock, segments: list[list[Segment]], kind: str, mode: str) -> dict[str, list[float]]:
    """Per phase (and "total"), each PE's device (or wall) time in microseconds."""
    per_step = [[clock.us(s) for s in pe] for pe in segments]
    phases = {name: [sum(pe[a:b]) for pe in per_step] for name, (a, b) in PHASES[(kind, mode)].items()}
    return {**phases, "total": [sum(pe) for pe in per_step]}


def starved_steps(segments: list[list[Segment]], kind: str, mode: str) -> int:
    """Segments that ran dry, other than the steps that read the device on purpose."""
    allowed = HOST_READ_STEPS.get((kind, mode), set())
    return sum(s.starved for pe in segments for i, s in enumerate(pe) if i not in allowed)


def median_of(reps: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(rep[key] for rep in reps) for key in reps[0]}


def time_mode(
    dispatchers: Sequence[Any],
    inputs: Sequence[tuple[torch.Tensor, ...]],
    mode: str,
    bound: int | None,
    clock: Clock,
    warmup: int,
    reps: int,
) -> tuple[dict[str, float], list[Any], int]:
    """Dispatch, then combine of the dispatched rows as they are (identity experts), on every PE
    in lockstep: `reps` accepted repeats after `warmup`. Returns the medians of the per-PE means
    (`<kind>_<phase>_us`; low-latency also `host_enqueue_us`, the host's time per PE to queue
    both, which CUDA graphs would remove), the last repeat's dispatch outputs, and how many
    repeats were measured again because a segment ran dry."""
    pes = len(dispatchers)

    def dispatch_steps() -> list[Generator]:
        return [d.dispatch_steps(*i, bound) for d, i in zip(dispatchers, inputs)]

    def combine_steps(sent: list[Any]) -> list[Generator]:
        return [d.combine_steps(o.hidden, o.handle) for d, o in zip(dispatchers, sent)]

    def once() -> tuple[dict[str, float], list[Any], int]:
        sent, d_segs, d_host = timed_lockstep(dispatch_steps(), clock, HOST_READ_STEPS.get(("dispatch", mode), ()))
        _, c_segs, c_host = timed_lockstep(combine_steps(sent), clock)
        clock.settle()
        figures = {}
        for kind, segs in (("dispatch", d_segs), ("combine", c_segs)):
            for phase, per_pe in phase_us(clock, segs, kind, mode).items():
                figures[f"{kind}_{phase}_us"] = statistics.fmean(per_pe)
        if mode == LOW_LATENCY:  # no host read: the host's time is its queueing alone
            figures["host_enqueue_us"] = (d_host + c_host) * 1e6 / pes
        return figures, sent, starved_steps(d_segs, "dispatch", mode) + starved_steps(c_segs, "combine", mode)

    for _ in range(warmup):  # untimed, so its wall time is the host's queueing plus any host reads
        started = time.perf_counter()
        run_lockstep(combine_steps(run_lockstep(dispatch_steps())))
        clock.settle()
        clock.ensure_sleep(2 * (time.perf_counter() - started))
    accepted, retried, sent = [], 0, []
    while len(accepted) < reps:
        figures, sent, starved = once()
        if starved and retried < 2 * reps:
            retried += 1
            clock.grow()
            continue
        accepted.append(figures)
    return median_of(accepted), sent, retried


def rows_per_chunk(sent: Sequence[Any]) -> list[int]:
    """Rows moved in each chunk, summed over the PEs (from the receivers' handles)."""
    return [int(x) for x in sum(o.handle.chunk_counts.sum(1) for o in sent).tolist()]


def traffic(
    figures: dict[str, float], chunk_rows: list[int], tokens: int, pes: int, row_bytes: int, out_row_bytes: int
) -> dict:
    """GB/s of the bytes the kernels must read and write, over every PE's time.

    A row sent is read from the sender's tokens and written into the receiver's slot, then read
    from the slot and written into the output: 2 bytes of traffic per payload byte per kernel,
    the accounting of a device-to-device copy's bandwidth (read + write). Metadata (4 bytes a
    row) is left out. The dispatch's "stream" steps receive every chunk and send all but the
    first; combine sends every row back (2x) and reduces, at the least reading each row once
    and writing each token once. row_bytes: a dispatched row on the wire (FP8: bytes and
    scales); out_row_bytes: an expert's output row, which combine moves."""
    rows = sum(chunk_rows)

    def gbps(nbytes: int, per_pe_us: float) -> float:
        return nbytes / (per_pe_us * pes) / 1e3 if per_pe_us > 0 else 0.0

    out = {
        "rows_moved": rows,
        "dispatch_gbps": gbps(4 * rows * row_bytes, figures["dispatch_total_us"]),
        "combine_gbps": gbps((3 * rows + tokens * pes) * out_row_bytes, figures["combine_total_us"]),
    }
    if "dispatch_stream_us" in figures:
        out["dispatch_stream_gbps"] = gbps(2 * row_bytes * (sum(chunk_rows[1:]) + rows), figures["dispatch_stream_us"])
    return out


def kernel_profile(run: Callable[[], object], device: torch.device, pes: int, top: int = 12) -> list[dict]:
    """Where one run's time goes, per PE, largest first: device time per kernel on CUDA (the
    zero-fill of a padded output, the sends, the waits, the small torch ops), host time per op on
    CPU (smoke: the same code path, figures of no interest)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        if cuda and event.device_type != DeviceType.CUDA:
            continue  # host-side ops: their kernels are rows of their own
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if us > 0:
            rows.append({"name": event.key[:120], "us": us / pes, "calls": event.count / pes})
    return sorted(rows, key=lambda row: -row["us"])[:top]
