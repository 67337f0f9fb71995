"""Acceptance 1: from a fake stream on a fake clock to exact latencies, goodput and attainment.

Times are multiples of 1/16 s, so every difference is exact in binary floating point and the
figures below are compared with ==; only percentiles that interpolate with a decimal weight
(p90, p99) carry rounding, and they are compared to 1e-12.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from loadtest_fakes import DONE, FakeClock, completion_script, record, text_chunk, usage_chunk

from moeserve.loadtest.metrics import (
    LatencyStats,
    Objectives,
    attainment,
    percentile,
    request_metrics,
    summarize,
    summarize_run,
    verdicts,
)

OBJECTIVES = Objectives(ttft=0.25, tbt=0.125, tpot=0.125, e2el=1.0)


@pytest.fixture(scope="module")
def run():
    """Six requests covering every case; the comments give what each must yield."""
    clock = FakeClock()
    records = [
        # A: ttft 0.125, gaps 0.125 x3, tpot 0.125, e2el 0.5 -> meets everything
        record(clock, 0.0, completion_script([0.125, 0.25, 0.375, 0.5], 4), index=0),
        # B: ttft 0.125, gaps (0.0625, 0.25, 0.0625): their mean and the TPOT are 0.125, on target,
        #    but one gap exceeds it, so B misses the per-gap TBT objective
        record(clock, 0.5, completion_script([0.625, 0.6875, 0.9375, 1.0], 4), index=1),
        # C: one output token: ttft 0.25 (on target), no gap, no TPOT -> meets tbt and tpot trivially
        record(clock, 1.0, completion_script([1.25], 1), index=2),
        # D: HTTP 503 -> failed: meets nothing, left out of every latency
        record(clock, 1.5, [(1.5, b'{"error": "overloaded"}')], status=503, index=3),
        # E: slow first token: ttft 0.75 misses; gap 0.0625, tpot 0.0625, e2el 0.8125 meet
        record(clock, 2.0, completion_script([2.75, 2.8125], 2), index=4),
        # F: a stream that finishes without content -> failed (empty_output)
        record(clock, 3.0, [(3.125, text_chunk("", "length")), (3.25, usage_chunk(0)), (3.25, DONE)], index=5),
    ]
    metrics = [request_metrics(r, run_start=0.0) for r in records]
    return records, metrics, summarize_run(metrics, OBJECTIVES, duration_s=3.25)


def test_per_request_figures(run):
    _, metrics, _ = run
    a, b, c, d, e, f = metrics
    assert (a.ttft, a.gaps, a.tpot, a.e2el, a.output_tokens) == (0.125, (0.125, 0.125, 0.125), 0.125, 0.5, 4)
    assert (b.ttft, b.gaps, b.tpot, b.e2el) == (0.125, (0.0625, 0.25, 0.0625), 0.125, 0.5)
    assert (c.ttft, c.gaps, c.tpot, c.e2el, c.output_tokens) == (0.25, (), None, 0.25, 1)
    assert (d.ok, d.error, d.ttft, d.gaps, d.e2el) == (False, "http_5xx", None, (), None)
    assert "503" in d.error_detail and "overloaded" in d.error_detail
    assert (e.ttft, e.gaps, e.tpot, e.e2el) == (0.75, (0.0625,), 0.0625, 0.8125)
    assert (f.ok, f.error) == (False, "empty_output")
    assert [m.send_offset for m in metrics] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0]
    assert a.token_source == "usage"


def test_verdicts_per_objective(run):
    _, metrics, _ = run
    got = [verdicts(m, OBJECTIVES) for m in metrics]
    assert got == [
        {"ttft": True, "tbt": True, "tpot": True, "e2el": True},
        {"ttft": True, "tbt": False, "tpot": True, "e2el": True},  # per gap, not on average
        {"ttft": True, "tbt": True, "tpot": True, "e2el": True},  # one token: nothing to miss
        {"ttft": False, "tbt": False, "tpot": False, "e2el": False},  # failed
        {"ttft": False, "tbt": True, "tpot": True, "e2el": True},
        {"ttft": False, "tbt": False, "tpot": False, "e2el": False},  # failed
    ]


def test_run_summary(run):
    _, _, s = run
    assert (s.num_sent, s.num_completed, s.num_failed) == (6, 4, 2)
    assert s.errors == {"empty_output": 1, "http_5xx": 1}
    assert s.attainment == {"ttft": 3 / 6, "tbt": 3 / 6, "tpot": 4 / 6, "e2el": 4 / 6, "all": 2 / 6}
    assert s.goodput == 2 / 3.25  # A and C meet every objective
    assert s.request_throughput == 4 / 3.25
    assert s.total_output_tokens == 4 + 4 + 1 + 2
    assert s.output_throughput == 11 / 3.25
    assert s.total_input_tokens == 4 * 3  # the usage's prompt_tokens of the completed ones


def test_latency_percentiles(run):
    _, _, s = run
    # TTFT of A, B, C, E: sorted 0.125, 0.125, 0.25, 0.75
    assert (s.ttft.count, s.ttft.mean, s.ttft.median, s.ttft.max) == (4, 0.3125, 0.1875, 0.75)
    assert s.ttft.p90 == pytest.approx(0.25 + 0.7 * 0.5, rel=1e-12)
    assert s.ttft.p99 == pytest.approx(0.25 + 0.97 * 0.5, rel=1e-12)
    # every gap, pooled: 0.0625 x3, 0.125 x3, 0.25
    assert (s.tbt.count, s.tbt.mean, s.tbt.median, s.tbt.max) == (7, 0.8125 / 7, 0.125, 0.25)
    assert s.tbt.p90 == pytest.approx(0.125 + 0.4 * 0.125, rel=1e-12)
    assert s.tbt.p99 == pytest.approx(0.125 + 0.94 * 0.125, rel=1e-12)
    # TPOT of A, B, E (C has one token): 0.0625, 0.125, 0.125
    assert s.tpot == LatencyStats(3, 0.3125 / 3, 0.125, 0.125, 0.125, 0.125)
    # E2EL: 0.25, 0.5, 0.5, 0.8125
    assert (s.e2el.count, s.e2el.mean, s.e2el.median, s.e2el.max) == (4, 0.515625, 0.5, 0.8125)
    assert s.e2el.p90 == pytest.approx(0.5 + 0.7 * 0.3125, rel=1e-12)


def test_without_objectives_there_is_no_goodput(run):
    _, metrics, _ = run
    s = summarize_run(metrics, Objectives(), duration_s=3.25)
    assert s.goodput is None and s.attainment == {}


def test_only_given_objectives_count(run):
    _, metrics, _ = run
    assert attainment(metrics, Objectives(tbt=0.125)) == {"tbt": 0.5, "all": 0.5}
    assert attainment(metrics, Objectives(tbt=0.25)) == {"tbt": 4 / 6, "all": 4 / 6}  # B's 0.25 gap is on target


def test_nothing_sent_and_nothing_completed():
    s = summarize_run([], OBJECTIVES, duration_s=0.0)
    assert (s.num_sent, s.request_throughput, s.goodput, s.ttft) == (0, 0.0, 0.0, None)
    assert s.attainment == {"ttft": 0.0, "tbt": 0.0, "tpot": 0.0, "e2el": 0.0, "all": 0.0}


def test_percentile_is_numpys_linear_interpolation():
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=0)
    assert summarize([2.0]) == LatencyStats(1, 2.0, 2.0, 2.0, 2.0, 2.0)
    assert summarize([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)
