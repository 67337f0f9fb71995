"""Latency figures, SLO verdicts, goodput and attainment from what the client saw: pure functions.

Every figure is derived from `RequestRecord`s (monotonic timestamps), so a fake clock gives exact
numbers in tests. Definitions, in seconds here (the report converts to ms):

- TTFT: send to the first content chunk. E2EL: send to the end of the stream.
- TBT: every gap between consecutive content chunks of a request; a request with one content
  chunk has no gaps.
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
- A failed request has none of these: it is left out of every latency summary, meets no
  objective and counts as a miss in attainment.
- The TBT objective is per gap: a request meets it when EVERY gap is within the target (true
  with no gaps). TPOT meets trivially with a single output token, as there is nothing to average.
- Percentiles interpolate linearly between order statistics (numpy's default, "linear"):
  the q-th percentile of n sorted values sits at position (n - 1) * q / 100.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the type: the metrics stay free of the HTTP client
    from moeserve.loadtest.client import RequestRecord

OBJECTIVE_KINDS = ("ttft", "tbt", "tpot", "e2el")


@dataclass(frozen=True)
class Objectives:
    """SLO targets in seconds; None = not an objective of this run."""

    ttft: float | None = None
    tbt: float | None = None
    """Bound on every single gap between content chunks of a request."""
    tpot: float | None = None
    e2el: float | None = None

    def given(self) -> dict[str, float]:
        """The objectives that are set, by kind, in `OBJECTIVE_KINDS` order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class RequestMetrics:
    """One request's latencies (seconds); all None when it failed."""

    index: int
    error: str | None
    error_detail: str
    send_offset: float
    """Send time relative to the run's start."""
    prompt_tokens: int | None
    output_tokens: int
    token_source: str
    """Where `output_tokens` came from: "usage", "tokenizer", "chunks" ("" when failed)."""
    ttft: float | None
    gaps: tuple[float, ...]
    tpot: float | None
    e2el: float | None

    @property
    def ok(self) -> bool:
        return self.error is None


def request_metrics(record: RequestRecord, run_start: float) -> RequestMetrics:
    """The figures of one request; a failed one keeps only its error and when it was sent."""
    if record.error is not None:
        return RequestMetrics(
            record.index,
            record.error,
            record.error_detail,
            record.send_time - run_start,
            record.prompt_tokens,
            0,
            "",
            None,
            (),
            None,
            None,
        )
    times = record.chunk_times
    ttft = times[0] - record.send_time
    e2el = record.end_time - record.send_time
    gaps = tuple(b - a for a, b in zip(times, times[1:]))
    n_out = record.output_tokens
    tpot = (e2el - ttft) / (n_out - 1) if n_out > 1 else None
    return RequestMetrics(
        record.index,
        None,
        "",
        record.send_time - run_start,
        record.prompt_tokens,
        n_out,
        record.token_source,
        ttft,
        gaps,
        tpot,
        e2el,
    )


def verdicts(m: RequestMetrics, objectives: Objectives) -> dict[str, bool]:
    """Whether `m` meets each given objective; a failed request meets none."""
    met = {}
    for kind, target in objectives.given().items():
        if not m.ok:
            met[kind] = False
        elif kind == "ttft":
            met[kind] = m.ttft <= target
        elif kind == "tbt":
            met[kind] = all(gap <= target for gap in m.gaps)
        elif kind == "tpot":
            met[kind] = m.tpot is None or m.tpot <= target
        else:
            met[kind] = m.e2el <= target
    return met


def meets_all(m: RequestMetrics, objectives: Objectives) -> bool:
    return m.ok and all(verdicts(m, objectives).values())


def attainment(requests: Sequence[RequestMetrics], objectives: Objectives) -> dict[str, float]:
    """Fraction of the sent requests meeting each given objective, and "all" of them.

    Empty when no objective is given; 0.0 for every kind when no request was sent (nothing met).
    """
    if not objectives.given():
        return {}
    n = len(requests)
    met = Counter()
    for m in requests:
        for kind, ok in verdicts(m, objectives).items():
            met[kind] += ok
        met["all"] += meets_all(m, objectives)
    return {kind: (met[kind] / n if n else 0.0) for kind in [*objectives.given(), "all"]}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values` by linear interpolation, as numpy.percentile."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency over a run, in the unit it was given (seconds here)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float

    def scaled(self, factor: float) -> LatencyStats:
        return LatencyStats(
            self.count,
            self.mean * factor,
            self.median * factor,
            self.p90 * factor,
            self.p99 * factor,
            self.max * factor,
        )


def summarize(values: Sequence[float]) -> LatencyStats | None:
    """mean, median, p90, p99 and max; None for no values (no successful request)."""
    if not values:
        return None
    return LatencyStats(
        len(values),
        math.fsum(values) / len(values),
        percentile(values, 50),
        percentile(values, 90),
        percentile(values, 99),
        max(values),
    )


@dataclass(frozen=True)
class RunSummary:
    """What one run at one rate amounts to. Rates are per second of `duration_s`."""

    duration_s: float
    """From the run's start (the first scheduled arrival) to the end of its last request."""
    num_sent: int
    num_completed: int
    num_failed: int
    errors: dict[str, int]
    total_input_tokens: int
    """Prompt tokens of completed requests, as the server's usage (or the dataset) counts them."""
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    goodput: float | None
    """Requests per second meeting every given objective; None without objectives."""
    attainment: dict[str, float]
    ttft: LatencyStats | None
    tbt: LatencyStats | None
    """Over every gap of every completed request, pooled."""
    tpot: LatencyStats | None
    e2el: LatencyStats | None


def summarize_run(requests: Sequence[RequestMetrics], objectives: Objectives, duration_s: float) -> RunSummary:
    done = [m for m in requests if m.ok]
    errors = Counter(m.error for m in requests if not m.ok)

    def per_second(count: float) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    good = sum(meets_all(m, objectives) for m in requests)
    output_tokens = sum(m.output_tokens for m in done)
    return RunSummary(
        duration_s=duration_s,
        num_sent=len(requests),
        num_completed=len(done),
        num_failed=len(requests) - len(done),
        errors=dict(sorted(errors.items())),
        total_input_tokens=sum(m.prompt_tokens or 0 for m in done),
        total_output_tokens=output_tokens,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(output_tokens),
        goodput=per_second(good) if objectives.given() else None,
        attainment=attainment(requests, objectives),
        ttft=summarize([m.ttft for m in done]),
        tbt=summarize(list(_all_gaps(done))),
        tpot=summarize([m.tpot for m in done if m.tpot is not None]),
        e2el=summarize([m.e2el for m in done]),
    )


def _all_gaps(requests: Iterable[RequestMetrics]) -> Iterable[float]:
    for m in requests:
        yield from m.gaps
