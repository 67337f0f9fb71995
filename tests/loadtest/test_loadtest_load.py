"""Arrival processes, the bounded runner and the rate search, without a server."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from moeserve.loadtest.arrivals import arrival_offsets
from moeserve.loadtest.client import RequestRecord
from moeserve.loadtest.datasets import Prompt
from moeserve.loadtest.runner import LoadSettings, run_at_rate
from moeserve.loadtest.search import Probe, SearchSettings, find_max_rate

PROMPTS = [Prompt([10 + i], 1, 1) for i in range(100)]


@pytest.mark.parametrize(("burstiness", "cv"), [(1.0, 1.0), (4.0, 0.5), (1e4, 0.01)])
def test_arrivals_have_the_mean_rate_and_the_gamma_cv(burstiness, cv):
    offsets = arrival_offsets(20001, rate=5.0, burstiness=burstiness, seed=0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(offsets) == 20001
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.03)


def test_arrivals_are_seeded_and_scale_with_the_rate():
    base = arrival_offsets(50, 1.0, 1.0, seed=3)
    assert arrival_offsets(50, 1.0, 1.0, seed=3) == base
    assert arrival_offsets(50, 1.0, 1.0, seed=4) != base
    assert arrival_offsets(50, 4.0, 1.0, seed=3) == pytest.approx([t / 4 for t in base], rel=1e-12)
    assert arrival_offsets(5, math.inf, 1.0, seed=3) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0, 1.0, seed=3)


def _sender(service_s: float, log: dict):
    """A fake send that takes `service_s` and tracks how many requests are in flight."""
    log.update(in_flight=0, peak=0, sent=[])

    async def send(index: int, prompt: Prompt) -> RequestRecord:
        log["in_flight"] += 1
        log["peak"] = max(log["peak"], log["in_flight"])
        log["sent"].append(index)
        await asyncio.sleep(service_s)
        log["in_flight"] -= 1
        return RequestRecord(index=index, send_time=0.0, end_time=0.0)

    return send


def test_concurrency_cap_holds_due_requests_back():
    log: dict = {}
    load = LoadSettings(burstiness=1.0, max_concurrency=3, duration_s=60.0, seed=0)
    result = asyncio.run(run_at_rate(_sender(0.02, log), PROMPTS[:10], math.inf, load, progress=False))
    assert log["peak"] == 3
    assert [r.index for r in result.records] == list(range(10))


def test_duration_stops_sending_and_lets_in_flight_requests_finish():
    log: dict = {}
    load = LoadSettings(burstiness=1.0, max_concurrency=None, duration_s=0.25, seed=1)
    due = sum(t < 0.25 for t in arrival_offsets(len(PROMPTS), 100.0, 1.0, seed=1))
    result = asyncio.run(run_at_rate(_sender(0.3, log), PROMPTS, 100.0, load, progress=False))
    assert 10 < due < 50
    assert log["sent"] == list(range(due))  # everything due before the end, in order, and nothing after
    assert len(result.records) == due and result.planned == len(PROMPTS)  # in flight at the end: answered


def test_a_capped_run_does_not_send_after_the_duration():
    log: dict = {}
    load = LoadSettings(burstiness=1.0, max_concurrency=1, duration_s=0.5, seed=0)
    result = asyncio.run(run_at_rate(_sender(0.2, log), PROMPTS, math.inf, load, progress=False))
    assert len(result.records) == 3  # sent at 0, 0.2 and 0.4 s; the rest waited past 0.5 s (0.1 s to spare)


def _knee(knee: float):
    """A fake probe: every request meets the SLOs up to the knee rate, none above it."""

    async def probe(rate: float) -> float:
        return 1.0 if rate <= knee else 0.0

    return probe


def test_search_doubles_then_bisects_to_the_tolerance():
    result = asyncio.run(find_max_rate(_knee(5.3), SearchSettings(target=0.99, start_rate=1.0, tolerance=0.05)))
    assert [p.rate for p in result.probes] == [1, 2, 4, 8, 6, 5, 5.5, 5.25]
    assert (result.max_rate, result.min_failing_rate, result.bracketed) == (5.25, 5.5, True)
    assert result.probes[-1] == Probe(5.25, 1.0, True)


def test_search_halves_from_a_start_above_the_knee():
    result = asyncio.run(find_max_rate(_knee(5.3), SearchSettings(target=0.99, start_rate=16.0, tolerance=0.05)))
    assert [p.rate for p in result.probes] == [16, 8, 4, 6, 5, 5.5, 5.25]
    assert result.max_rate == 5.25


def test_search_reports_an_unbracketed_knee():
    never_fails = asyncio.run(find_max_rate(_knee(1e9), SearchSettings(target=0.99, max_probes=4)))
    assert ([p.rate for p in never_fails.probes], never_fails.max_rate, never_fails.bracketed) == (
        [1, 2, 4, 8],
        8,
        False,
    )
    never_passes = asyncio.run(find_max_rate(_knee(0.0), SearchSettings(target=0.99, max_probes=3)))
    assert ([p.rate for p in never_passes.probes], never_passes.max_rate) == ([1, 0.5, 0.25], None)
