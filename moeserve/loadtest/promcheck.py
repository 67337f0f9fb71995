"""Cross-check against the server's own SLO counters in /metrics (moeserve exports them).

Before and after a run the counters `moeserve:slo_requests_total`,
`moeserve:slo_ttft_met_requests_total` and `moeserve:slo_tbt_met_requests_total` are read; their
deltas are the server's verdicts over exactly the requests of the run (if nothing else talks to
the server meanwhile). The client judges its own measurements against the same targets, read from
`moeserve:slo_target_seconds{kind="ttft"|"tbt"}`, and both attainments are reported side by side.

They differ by construction only slightly: the server's clock starts when the engine accepts the
request and stops when a token exists, the client's spans the network and HTTP framing; the
server judges every gap between tokens, the client every gap between content chunks (a token
that decodes to no text yet travels with the next one). Requests the server refused before its
engine saw them (HTTP 4xx) are in the client's count but not the server's. A server without these
metrics is not an error: the cross-check says why it was skipped.

A server that speculates (`--speculative-config`) also exports its draft counters; their deltas
give the run's mean accepted length (tokens a drafting sequence gained per target step: kept
drafts + 1), reported beside the attainments.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from moeserve.loadtest.metrics import Objectives, RequestMetrics, attainment

REQUESTS = "moeserve:slo_requests_total"
TTFT_MET = "moeserve:slo_ttft_met_requests_total"
TBT_MET = "moeserve:slo_tbt_met_requests_total"
TARGET = "moeserve:slo_target_seconds"
DRAFTS = "moeserve:spec_decode_num_drafts_total"
ACCEPTED = "moeserve:spec_decode_num_accepted_tokens_total"


class MetricsUnavailable(Exception):
    """The server has no usable SLO counters; the message says why."""


@dataclass(frozen=True)
class SLOCounters:
    """One reading of the server's SLO counters (summed over models) and its targets."""

    requests: float
    ttft_met: float
    tbt_met: float
    ttft_target_s: float
    tbt_target_s: float
    spec_drafts: float = 0.0
    """Sequence-steps that fed drafts (0 where the server does not speculate)."""
    spec_accepted: float = 0.0
    """Draft tokens the server kept."""


def parse_slo_counters(text: str) -> SLOCounters:
    """The SLO counters in a Prometheus text exposition."""
    sums = {REQUESTS: 0.0, TTFT_MET: 0.0, TBT_MET: 0.0, DRAFTS: 0.0, ACCEPTED: 0.0}
    seen = set()
    targets: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
                    seen.add(sample.name)
                elif sample.name == TARGET and sample.labels.get("kind") in ("ttft", "tbt"):
                    targets[sample.labels["kind"]] = sample.value
    except ValueError as e:
        raise MetricsUnavailable(f"/metrics is not Prometheus text: {e}") from None
    required = {REQUESTS, TTFT_MET, TBT_MET}  # the draft counters exist only where the server speculates
    missing = sorted(required - seen) + [f'{TARGET}{{kind="{k}"}}' for k in ("ttft", "tbt") if k not in targets]
    if missing:
        raise MetricsUnavailable(f"/metrics lacks {', '.join(missing)}")
    return SLOCounters(
        sums[REQUESTS], sums[TTFT_MET], sums[TBT_MET], targets["ttft"], targets["tbt"], sums[DRAFTS], sums[ACCEPTED]
    )


async def read_metrics_text(session: aiohttp.ClientSession, base_url: str) -> str:
    """The server's /metrics exposition; MetricsUnavailable when it cannot be had."""
    try:
        async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            if response.status != 200:
                raise MetricsUnavailable(f"GET /metrics answered HTTP {response.status}")
            return await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise MetricsUnavailable(f"GET /metrics failed: {type(e).__name__}: {e}") from None


async def read_slo_counters(session: aiohttp.ClientSession, base_url: str) -> SLOCounters:
    return parse_slo_counters(await read_metrics_text(session, base_url))


@dataclass(frozen=True)
class CrossCheck:
    """Server-side and client-side TTFT/TBT attainment over one run, against the server's targets."""

    available: bool
    reason: str | None
    """Why the cross-check was skipped, when it was."""
    ttft_target_s: float | None = None
    tbt_target_s: float | None = None
    server_requests: int | None = None
    """Requests the server finished during the run (counter delta)."""
    client_requests: int | None = None
    """Requests the client sent during the run."""
    server_ttft: float | None = None
    server_tbt: float | None = None
    client_ttft: float | None = None
    client_tbt: float | None = None
    mean_accepted_length: float | None = None
    """Speculative decoding's kept drafts + 1 per drafting sequence-step over the run; None where
    the server drafted nothing."""

    @classmethod
    def skipped(cls, reason: str) -> CrossCheck:
        return cls(False, reason)


def compare(before: SLOCounters, after: SLOCounters, requests: Sequence[RequestMetrics]) -> CrossCheck:
    """Both sides' attainment; the client's over every request it sent (failures are misses)."""
    if (after.ttft_target_s, after.tbt_target_s) != (before.ttft_target_s, before.tbt_target_s):
        return CrossCheck.skipped("the server's SLO targets changed during the run")
    total = after.requests - before.requests
    if total <= 0:
        return CrossCheck.skipped("the server counted no finished request during the run")
    client = attainment(requests, Objectives(ttft=after.ttft_target_s, tbt=after.tbt_target_s))
    drafts = after.spec_drafts - before.spec_drafts
    return CrossCheck(
        available=True,
        reason=None,
        ttft_target_s=after.ttft_target_s,
        tbt_target_s=after.tbt_target_s,
        server_requests=round(total),
        client_requests=len(requests),
        server_ttft=(after.ttft_met - before.ttft_met) / total,
        server_tbt=(after.tbt_met - before.tbt_met) / total,
        client_ttft=client["ttft"],
        client_tbt=client["tbt"],
        mean_accepted_length=1 + (after.spec_accepted - before.spec_accepted) / drafts if drafts > 0 else None,
    )


async def settle(
    session: aiohttp.ClientSession, base_url: str, before: SLOCounters, expected: int, wait_s: float = 5.0
) -> SLOCounters:
    """The counters once the server has judged `expected` more requests, or after `wait_s`.

    The server counts a request when its engine lets go of it, which for a request the client
    cancelled (timeout) comes a moment after the client gave up.
    """
    deadline = time.monotonic() + wait_s
    while True:
        after = await read_slo_counters(session, base_url)
        if after.requests - before.requests >= expected or time.monotonic() >= deadline:
            return after
        await asyncio.sleep(0.05)
