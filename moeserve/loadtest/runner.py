"""One run at one request rate: open-loop arrivals, an optional concurrency cap, hard bounds.

Arrivals follow their schedule whatever the server does (open loop), so an overloaded server
shows up as growing TTFT rather than as a slower client. With `max_concurrency`, a request that
is due while the cap is reached waits on the client for a free slot; its TTFT counts from when
it is actually sent, as in vLLM. The run is bounded twice: by the prompts it is given, and by
`duration_s` after which nothing more is sent (neither due requests nor ones waiting for a
slot); requests in flight then end by themselves or at their own timeout. So every run stops
within duration + timeout.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from moeserve.loadtest.arrivals import arrival_offsets
from moeserve.loadtest.client import RequestRecord
from moeserve.loadtest.datasets import Prompt
from moeserve.loadtest.metrics import RequestMetrics, RunSummary
from moeserve.loadtest.promcheck import CrossCheck
from moeserve.loadtest.slo_mix import ClassReport

Send = Callable[[int, Prompt], Awaitable[RequestRecord]]
"""Send prompt number i and return its record (never raises for server or network trouble)."""


@dataclass(frozen=True)
class LoadSettings:
    """How requests are offered; the same for every rate of a sweep or a search."""

    burstiness: float
    max_concurrency: int | None
    duration_s: float
    """After this many seconds of a run no new request is sent."""
    seed: int
    """Seeds the arrival process: every rate replays the same pattern, scaled."""


@dataclass(frozen=True)
class RunResult:
    request_rate: float
    planned: int
    """Prompts the run was given; fewer are sent when the duration runs out."""
    start_time: float
    """Clock reading when the run started (the first request is due then)."""
    records: list[RequestRecord]
    """The requests sent, in prompt order."""

    @property
    def duration_s(self) -> float:
        """Start to the end of the last request; 0 when nothing was sent."""
        return max((r.end_time for r in self.records), default=self.start_time) - self.start_time


async def run_at_rate(
    send: Send, prompts: Sequence[Prompt], rate: float, load: LoadSettings, *, progress: bool = True
) -> RunResult:
    """Offer `prompts` at `rate` requests/s (math.inf: all at once) and wait for every answer."""
    offsets = arrival_offsets(len(prompts), rate, load.burstiness, load.seed)
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    start = time.monotonic()
    deadline = start + load.duration_s
    bar = tqdm(
        total=len(prompts), desc=f"{rate:g} req/s", unit="req", file=sys.stderr, disable=not progress, leave=False
    )

    async def one(index: int, prompt: Prompt) -> RequestRecord | None:
        if slots is None:
            return await send(index, prompt)
        async with slots:
            if time.monotonic() >= deadline:
                return None
            return await send(index, prompt)

    tasks = []
    for index, (offset, prompt) in enumerate(zip(offsets, prompts)):
        due = start + offset
        if due >= deadline:
            break
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(index, prompt))
        task.add_done_callback(lambda _: bar.update())
        tasks.append(task)
    results = await asyncio.gather(*tasks)
    bar.close()
    return RunResult(rate, len(prompts), start, [r for r in results if r is not None])


@dataclass(frozen=True)
class RunReport:
    """A finished run, measured: what the report, the JSON and the plots are made of."""

    request_rate: float
    planned: int
    requests: list[RequestMetrics]
    summary: RunSummary
    cross_check: CrossCheck
    classes: tuple[ClassReport, ...] = ()
    """Per SLO class of `--slo-mix`; empty without one."""
