"""`--slo-mix`: the spec, the seeded class draw, the `slo` body field, per-class figures both sides."""

from __future__ import annotations

import pytest
from loadtest_fakes import PROMPT, SETTINGS, FakeClock, completion_script, record
from prometheus_client import CollectorRegistry, Counter, generate_latest

from moeserve.loadtest.cli import main
from moeserve.loadtest.client import request_payload
from moeserve.loadtest.metrics import Objectives, request_metrics, summarize_run
from moeserve.loadtest.promcheck import CrossCheck
from moeserve.loadtest.report import run_json, run_table
from moeserve.loadtest.runner import RunReport
from moeserve.loadtest.slo_mix import (
    ClassCounts,
    MixClass,
    assign_classes,
    class_reports,
    parse_class_counters,
    parse_slo_mix,
)

MIX = "chat:0.7:ttft=500,tbt=50;batch:0.3:ttft=20000,tbt=200"


def test_the_spec_parses_to_classes_in_seconds():
    assert parse_slo_mix(MIX) == (MixClass("chat", 0.7, 0.5, 0.05), MixClass("batch", 0.3, 20.0, 0.2))
    assert parse_slo_mix(" solo : 1 : tbt=10 , ttft=100 ;") == (MixClass("solo", 1.0, 0.1, 0.01),)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "names no class"),
        ("chat:0.7", "is not NAME:WEIGHT:ttft=MS,tbt=MS"),
        ("chat:0.7:ttft=500", "needs exactly ttft=MS,tbt=MS"),
        ("chat:0.7:ttft=500,tbt=50,e2e=9", "needs exactly ttft=MS,tbt=MS"),
        ("chat:zero:ttft=500,tbt=50", "weight must be a positive number"),
        ("chat:1:ttft=-5,tbt=50", "ttft must be a positive number"),
        ("chat:1:ttft=5,tbt=inf", "tbt must be a positive number"),
        ("c h:1:ttft=5,tbt=5", "letters, digits"),
        ("a:1:ttft=5,tbt=5;a:1:ttft=6,tbt=6", "twice"),
    ],
)
def test_a_bad_spec_says_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_slo_mix(spec)


def test_a_bad_spec_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--slo-mix", "chat:0.7"])
    assert exit_.value.code == 2 and "--slo-mix: 'chat:0.7' is not NAME:WEIGHT" in capsys.readouterr().err


def test_classes_are_drawn_by_weight_with_the_seed():
    mix = parse_slo_mix(MIX)
    draw = assign_classes(1000, mix, seed=3)
    assert draw == assign_classes(1000, mix, seed=3) and draw != assign_classes(1000, mix, seed=4)
    assert 650 < draw.count(0) < 750 and set(draw) == {0, 1}


def test_a_request_carries_its_class_targets_in_its_slo_field():
    _, body = request_payload(SETTINGS, PROMPT.__class__(PROMPT.prompt, 3, 8, slo_ms=(500.0, 50.0)))
    assert body["slo"] == {"ttft_ms": 500.0, "tbt_ms": 50.0}
    assert "slo" not in request_payload(SETTINGS, PROMPT)[1]


def test_server_counters_are_summed_by_class_and_differenced():
    registry = CollectorRegistry()
    names = ("moeserve:slo_class_requests", "moeserve:slo_class_ttft_met_requests", "moeserve:slo_rejections")
    counters = [Counter(n, "doc", ["model_name", "class"], registry=registry) for n in names]
    for model in ("a", "b"):
        for counter, value in zip(counters, (4, 3, 2)):
            counter.labels(model, "chat").inc(value)
    counts = parse_class_counters(generate_latest(registry).decode())
    assert counts == {"chat": ClassCounts(requests=8, ttft_met=6, tbt_met=0, rejections=4)}
    assert counts["chat"].minus(ClassCounts(requests=2, rejections=1)) == ClassCounts(6, 6, 0, 3)


def test_each_class_is_judged_by_its_own_targets_and_refusals_count_apart():
    """Four requests over a 2 s run: chat (TTFT 500 ms) gets one on time, one late at 600 ms and
    one refused; batch (TTFT 20 s) gets the one at 600 ms, which is on time for it."""
    clock = FakeClock()
    mix = parse_slo_mix(MIX)
    records = [
        record(clock, 0.0, completion_script([0.1, 0.12], 2), index=0),
        record(clock, 0.0, completion_script([0.6, 0.62], 2), index=1),
        record(clock, 0.0, [(0.0, b'{"error": "slo"}')], status=429, index=2),
        record(clock, 1.0, completion_script([1.6, 2.0], 2), index=3),
    ]
    requests = [request_metrics(r, 0.0) for r in records]
    chat, batch = class_reports(mix, [0, 0, 0, 1], requests, 2.0, {"chat": ClassCounts(2, 1, 2, 1)})
    assert (chat.num_sent, chat.num_rejected, chat.num_completed) == (3, 1, 2)
    assert chat.attainment == {"ttft": pytest.approx(1 / 3), "tbt": pytest.approx(2 / 3), "all": pytest.approx(1 / 3)}
    assert chat.admitted_attainment["all"] == 0.5 and chat.goodput == 0.5
    assert batch.attainment["all"] == 0.0  # its one gap, 400 ms, is over batch's 200 ms TBT
    assert batch.server is None and chat.server.rejections == 1

    summary = summarize_run(requests, Objectives(), 2.0)
    report = RunReport(1.0, 4, requests, summary, CrossCheck.skipped("off"), (chat, batch))
    doc = run_json(report)["slo_classes"]
    assert doc[0]["server"] == {"requests": 2, "rejections": 1, "ttft": 0.5, "tbt": 1.0}
    assert doc[1]["targets_ms"] == {"ttft": 20000.0, "tbt": 200.0} and doc[1]["server"] is None
    table = run_table(report, Objectives())
    assert "Per SLO class" in table and "chat" in table and "50.0%/100.0%" in table
