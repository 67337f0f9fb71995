"""The cross-check's parsing, the JSON document, tables, plots, datasets and flag errors."""

from __future__ import annotations

import json
import struct

import pytest
from loadtest_fakes import FakeClock, completion_script, record
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from moeserve.loadtest.cli import main
from moeserve.loadtest.datasets import RANDOM_MIN_TOKEN_ID, jsonl_prompts, random_prompts, sharegpt_prompts
from moeserve.loadtest.metrics import Objectives, request_metrics, summarize_run
from moeserve.loadtest.promcheck import CrossCheck, MetricsUnavailable, compare, parse_slo_counters
from moeserve.loadtest.report import cross_check_text, plot, rate_table, run_json, run_table
from moeserve.loadtest.runner import RunReport
from moeserve.loadtest.search import Probe, SearchResult
from moeserve.loadtest.serve import BenchConfig, load_prompts

OBJECTIVES = Objectives(ttft=0.25, tbt=0.125)


def exposition(
    requests: float,
    ttft_met: float,
    tbt_met: float,
    targets: tuple[float, float] = (0.5, 0.025),
    models: tuple[str, ...] = ("a",),
) -> str:
    """/metrics as a server exporting the SLO counters would write it (prometheus_client itself)."""
    registry = CollectorRegistry()
    counters = [
        Counter(name, "doc", ["model_name"], registry=registry)
        for name in ("moeserve:slo_requests", "moeserve:slo_ttft_met_requests", "moeserve:slo_tbt_met_requests")
    ]
    target = Gauge("moeserve:slo_target_seconds", "doc", ["model_name", "kind"], registry=registry)
    for model in models:
        for counter, value in zip(counters, (requests, ttft_met, tbt_met)):
            counter.labels(model).inc(value)
        target.labels(model, "ttft").set(targets[0])
        target.labels(model, "tbt").set(targets[1])
    return generate_latest(registry).decode()


def test_slo_counters_are_read_and_summed_over_models():
    counters = parse_slo_counters(exposition(10, 7, 4, models=("a", "b")))
    assert (counters.requests, counters.ttft_met, counters.tbt_met) == (20, 14, 8)
    assert (counters.ttft_target_s, counters.tbt_target_s) == (0.5, 0.025)


def test_a_server_without_the_counters_is_reported_not_fatal():
    with pytest.raises(MetricsUnavailable, match="moeserve:slo_requests_total"):
        parse_slo_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")


def _metrics(ttft_and_gaps: list[tuple[float, list[float]]]):
    """Requests (sent at 0) whose first chunk comes at ttft and the next ones after each gap."""
    clock = FakeClock()
    out = []
    for i, (ttft, gaps) in enumerate(ttft_and_gaps):
        times = [ttft]
        for gap in gaps:
            times.append(times[-1] + gap)
        out.append(request_metrics(record(clock, 0.0, completion_script(times, len(times)), index=i), 0.0))
    return out


def test_cross_check_compares_counter_deltas_with_the_client_against_the_servers_targets():
    requests = _metrics([(0.25, [0.0]), (0.5, [0.0]), (0.75, [0.0]), (0.25, [0.125])])  # targets: TTFT 0.5, TBT 0.025
    check = compare(parse_slo_counters(exposition(10, 7, 4)), parse_slo_counters(exposition(14, 9, 7)), requests)
    assert (check.available, check.server_requests, check.client_requests) == (True, 4, 4)
    assert (check.server_ttft, check.server_tbt) == (2 / 4, 3 / 4)
    assert (check.client_ttft, check.client_tbt) == (3 / 4, 3 / 4)
    assert check.mean_accepted_length is None  # the server drafted nothing
    nothing = compare(parse_slo_counters(exposition(10, 7, 4)), parse_slo_counters(exposition(10, 7, 4)), requests)
    assert not nothing.available and "no finished request" in nothing.reason


def test_cross_check_reports_the_mean_accepted_length_of_a_speculating_server():
    def speculating(requests: float, drafts: float, accepted: float) -> str:
        registry = CollectorRegistry()
        Counter("moeserve:spec_decode_num_drafts", "doc", ["model_name"], registry=registry).labels("a").inc(drafts)
        kept = Counter("moeserve:spec_decode_num_accepted_tokens", "doc", ["model_name"], registry=registry)
        kept.labels("a").inc(accepted)
        return exposition(requests, 0, 0) + generate_latest(registry).decode()

    check = compare(parse_slo_counters(speculating(2, 10, 6)), parse_slo_counters(speculating(4, 30, 36)), [])
    assert check.mean_accepted_length == 1 + 30 / 20
    assert "mean accepted length 2.50" in cross_check_text(check)


def _report(rate: float, requests, cross: CrossCheck | None = None) -> RunReport:
    summary = summarize_run(requests, OBJECTIVES, duration_s=2.0)
    return RunReport(rate, len(requests), requests, summary, cross or CrossCheck.skipped("disabled (--no-cross-check)"))


def test_run_json_in_milliseconds():
    report = _report(2.0, _metrics([(0.125, [0.0625, 0.25]), (0.5, [])]))
    doc = run_json(report)
    assert doc["ttft_ms"] == {
        "count": 2,
        "mean": 312.5,
        "median": 312.5,
        "p90": pytest.approx(462.5),
        "p99": pytest.approx(496.25),
        "max": 500.0,
    }
    assert doc["requests"][0]["tbt_ms"] == [62.5, 250.0]
    assert doc["requests"][1]["tpot_ms"] is None
    assert doc["attainment"] == {"ttft": 0.5, "tbt": 0.5, "all": 0.0}
    assert doc["cross_check"] == {
        "available": False,
        "reason": "disabled (--no-cross-check)",
        "targets_ms": None,
        "server_requests": None,
        "client_requests": None,
        "server": None,
        "client": None,
        "mean_accepted_length": None,
    }
    json.dumps(doc, allow_nan=False)


def test_tables_show_figures_and_the_search_answer():
    cross = CrossCheck(True, None, 0.5, 0.025, 2, 2, 1.0, 0.5, 1.0, 0.5)
    report = _report(2.0, _metrics([(0.125, [0.0625]), (0.5, [])]), cross)
    table = run_table(report, OBJECTIVES)
    assert "Goodput (req/s meeting every objective)" in table and "ttft (TTFT <= 250 ms)" in table
    assert "TTFT met" in table and "TBT met (every gap)" in table
    search = SearchResult(2.0, 4.0, [Probe(2.0, 1.0, True), Probe(4.0, 0.5, False)])
    assert "Max goodput rate: 2 req/s (the lowest failing rate was 4 req/s)" in rate_table([report], search)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plots_are_pngs(tmp_path):
    one = _report(2.0, _metrics([(0.125, [0.0625, 0.25]), (0.5, [0.125])]))
    plot(tmp_path / "one.png", [one], OBJECTIVES)
    assert _png_size(tmp_path / "one.png") == (1600, 480)
    several = [one, _report(4.0, _metrics([(0.25, [0.125]), (1.0, [])]))]
    plot(tmp_path / "sweep.png", several, OBJECTIVES, SearchResult(2.0, 4.0, []), target=0.9)
    assert _png_size(tmp_path / "sweep.png") == (1600, 950)


def test_random_prompts_are_seeded_token_ids_in_range():
    prompts = random_prompts(200, input_len=20, output_len=10, range_ratio=0.5, vocab_size=50, seed=1, as_text=False)
    assert prompts == random_prompts(200, 20, 10, 0.5, 50, seed=1, as_text=False)
    assert {len(p.prompt) for p in prompts} == set(range(10, 31)) and all(
        p.prompt_len == len(p.prompt) for p in prompts
    )
    assert {p.output_len for p in prompts} == set(range(5, 16))
    assert min(min(p.prompt) for p in prompts) == RANDOM_MIN_TOKEN_ID and max(max(p.prompt) for p in prompts) == 49
    text = random_prompts(3, input_len=7, output_len=2, range_ratio=0.0, vocab_size=300, seed=1, as_text=True)
    assert all(len(p.prompt.split()) == 7 and p.prompt_len is None and p.output_len == 2 for p in text)


def test_jsonl_and_sharegpt(tmp_path):
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "hi", "output_len": 3}\n\n{"prompt": [5, 6]}\n')
    assert [(p.prompt, p.prompt_len, p.output_len) for p in jsonl_prompts(lines, 3, default_output_len=9)] == [
        ("hi", None, 3),
        ([5, 6], 2, 9),
        ("hi", None, 3),
    ]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        jsonl_prompts(tmp_path / "bad.jsonl", 5, 9)
    share = tmp_path / "sg.json"
    share.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a" * 40}]},
                {"conversations": [{"from": "human", "value": "lonely"}]},
            ]
        )
    )
    assert [(p.prompt, p.output_len) for p in sharegpt_prompts(share, 2, seed=0, count_tokens=None)] == [
        ("q1", 10),
        ("q1", 10),
    ]
    assert sharegpt_prompts(share, 1, seed=0, count_tokens=len)[0].output_len == 40


def test_chat_refuses_token_id_prompts_before_sending_anything(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"prompt": [5, 6]}\n')
    config = BenchConfig(
        "http://x", endpoint="chat", dataset_name="jsonl", dataset_path=str(tmp_path / "ids.jsonl"), num_prompts=1
    )
    with pytest.raises(ValueError, match="chat endpoint takes text only"):
        load_prompts(config, None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "foo:1"], "expected KIND:MS"),
        (["--goodput", "ttft:-5"], "positive"),
        (["--goodput", "ttft:5", "ttft:6"], "twice"),
        (["--request-rate", "0"], "must be positive"),
        (["--sweep-rates", "1,inf"], "finite"),
        (["--sweep-rates", "1,2", "--find-max-goodput-rate"], "not allowed with"),
        (["--find-max-goodput-rate"], "needs --goodput"),
        (["--sweep-rates", "1", "--request-rate", "3"], "--request-rate is for a single run"),
        (["--slo-attainment", "1.5"], "fraction"),
        (["--dataset-name", "jsonl"], "needs --dataset-path"),
        (["--random-range-ratio", "1"], "[0, 1)"),
    ],
)
def test_bad_flags_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: moeserve bench serve" in err and message in err
