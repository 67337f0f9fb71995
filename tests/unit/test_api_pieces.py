"""The HTTP layer's small parts, without a server: stream deltas, metrics, stream merging, sizes."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moeserve.api.metrics import ServerMetrics
from moeserve.api.streaming import SampleCursor
from moeserve.api.transport import merge
from moeserve.config import SLOConfig
from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.engine.outputs import CompletionOutput
from moeserve.engine.stats import IterationStats, RequestMetrics
from moeserve.engine_config import parse_bytes
from moeserve.eplb import RebalanceReport
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler.block_groups import GroupBlocks


def sample(text: str, tokens: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=0, text=text, token_ids=list(range(tokens)), finish_reason=finish)


def test_cursor_sends_each_piece_once() -> None:
    cursor = SampleCursor(SamplingParams())
    deltas = [
        cursor.advance(sample(t, n, f))
        for t, n, f in [("He", 1, None), ("He", 2, None), ("Hello", 3, None), ("Hello!", 4, "length")]
    ]
    assert [d.text if d else None for d in deltas] == ["He", None, "llo", "!"]
    assert deltas[2].token_ids == [1, 2]  # the token that decoded to nothing rides with the next text
    assert deltas[3].finish_reason == "length" and deltas[3].text_offset == 5
    assert cursor.advance(sample("Hello!", 4, "length")) is None


def test_cursor_holds_back_a_possible_stop_string() -> None:
    """'EN' could be the start of the stop string 'END': it is not sent until it is not."""
    cursor = SampleCursor(SamplingParams(stop=["END"]))
    assert cursor.advance(sample("abEN", 2)).text == "ab"
    assert cursor.advance(sample("abENx", 3)).text == "E"  # the last two characters are held back
    assert cursor.advance(sample("abENxy", 4, "length")).text == "Nxy"


def test_metrics_record_and_expose() -> None:
    metrics = ServerMetrics("m", SLOConfig(ttft_s=0.5, tbt_s=0.02))
    done = RequestMetrics("length", 7, 3, 0.01, 0.2, 0.3, 0.03, ttft_met=True, tbt_met=False)
    metrics.record(
        IterationStats(
            0.01,
            7,
            3,
            1,
            [0.2],
            [0.01, 0.03],
            [done],
            num_running=2,
            num_waiting=1,
            kv_blocks_used=5,
            kv_blocks_total=9,
            state_slots_used=2,
            state_slots_total=4,
            saved_states_held=3,
            saved_states_total=6,
            group_blocks=(GroupBlocks("window", 1, 4), GroupBlocks("compressed_4", 4, 5)),
        )
    )
    samples = {
        (s.name, s.labels.get("finished_reason"), s.labels.get("le")): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    assert samples["moeserve:time_to_first_token_seconds_count", None, None] == 1
    assert samples["moeserve:time_between_tokens_seconds_count", None, None] == 2
    assert samples["moeserve:time_between_tokens_seconds_bucket", None, "0.02"] == 1  # the target is a bucket edge
    assert samples["moeserve:request_success_total", "length", None] == 1
    assert samples["moeserve:request_success_total", "abort", None] == 0
    assert samples["moeserve:slo_ttft_met_requests_total", None, None] == 1
    assert samples["moeserve:slo_tbt_met_requests_total", None, None] == 0
    assert samples["moeserve:slo_met_requests_total", None, None] == 0  # goodput counts only both targets met
    assert samples["moeserve:kv_cache_blocks_used", None, None] == 5
    assert [samples[f"moeserve:{name}", None, None] for name in ("state_slots_used", "state_slots_total")] == [2, 4]
    assert [samples[f"moeserve:{name}", None, None] for name in ("saved_states_held", "saved_states_total")] == [3, 6]
    assert samples["moeserve:num_preemptions_total", None, None] == 1
    by_group = {
        (name, group): metrics.registry.get_sample_value(
            f"moeserve:kv_cache_group_blocks_{name}", {"model_name": "m", "group": group}
        )
        for name in ("used", "total")
        for group in ("window", "compressed_4")
    }
    assert by_group == {
        ("used", "window"): 1,
        ("total", "window"): 4,
        ("used", "compressed_4"): 4,
        ("total", "compressed_4"): 5,
    }


def test_admission_promises_count_the_core_s_running_totals_once() -> None:
    metrics = ServerMetrics("m", SLOConfig())

    def value(name: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m"})

    for promised, kept in ((3, 2), (5, 4), (0, 0), (5, 4), (6, 5)):  # (0, 0): a frame with no scheduler
        metrics.record(IterationStats(0.01, ttft_promised=promised, ttft_promises_kept=kept))
    assert value("moeserve:slo_admission_promised_requests_total") == 6
    assert value("moeserve:slo_admission_promises_kept_total") == 5


def test_rebalances_count_up_and_the_last_one_sets_the_gauges() -> None:
    metrics = ServerMetrics("m", SLOConfig())

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("moeserve:eplb_rebalances_total") == 0  # exported before the first one
    first = RebalanceReport(12, (1.5, 2.0), (1.03, 1.1), 45, 1_100_000, 0.004, 0.028)
    second = RebalanceReport(24, (1.1, 1.2), (1.01, 1.05), 3, 73_728, 0.002, 0.006)
    metrics.record(IterationStats(0.01, rebalances=[first]))
    metrics.record(IterationStats(0.01))  # a step without one changes nothing
    assert value("moeserve:eplb_last_rebalance_seconds") == pytest.approx(0.032)
    assert value("moeserve:eplb_last_rebalance_imbalance", when="before", over="mean") == 1.5
    metrics.record(IterationStats(0.01, rebalances=[second]))
    assert value("moeserve:eplb_rebalances_total") == 2
    assert value("moeserve:eplb_moved_experts_total") == 48
    assert value("moeserve:eplb_moved_bytes_total") == 1_100_000 + 73_728
    assert value("moeserve:eplb_last_rebalance_seconds") == pytest.approx(0.008)
    gauges = {
        (when, over): value("moeserve:eplb_last_rebalance_imbalance", when=when, over=over)
        for when in ("before", "after")
        for over in ("mean", "worst")
    }
    assert gauges == {
        ("before", "mean"): 1.1,
        ("before", "worst"): 1.2,
        ("after", "mean"): 1.01,
        ("after", "worst"): 1.05,
    }


def test_the_imbalance_gauge_waits_for_enough_rows_and_restarts_at_a_rebalance() -> None:
    metrics = ServerMetrics("m", SLOConfig(), imbalance_min_rows=100, per_expert=True)

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("moeserve:expert_load_imbalance", {"model_name": "m", "layer": "3"})

    def report(*rank_rows: int, rebalanced: bool = False) -> None:
        routed = RoutedTokens([[sum(rank_rows)]], [list(rank_rows)], (3,))
        rebalances = [RebalanceReport(1, (2.0, 2.0), (1.0, 1.0), 1, 8, 0.0, 0.0)] if rebalanced else []
        metrics.record(IterationStats(0.01, routed_tokens=routed, rebalances=rebalances))

    report(30, 10)
    assert gauge() is None  # 40 rows: too few to say
    report(50, 10)
    assert gauge() == 80 / 50  # both reports' 100 rows
    report(60, 20, rebalanced=True)  # the last rows under the old placement: too few, and dropped
    report(40, 40)
    assert gauge() == 80 / 50
    report(10, 10)
    assert gauge() == 1.0  # 100 rows, all after the rebalance
    counted = metrics.registry.get_sample_value(
        "moeserve:ep_rank_routed_tokens_total", {"model_name": "m", "rank": "0"}
    )
    assert counted == 30 + 50 + 60 + 40 + 10  # the counters take every report at once


def test_prefix_cache_counters_add_up_in_tokens() -> None:
    metrics = ServerMetrics("m", SLOConfig())
    metrics.record(IterationStats(0.01, prefix_cache_queries=300, prefix_cache_hits=256))
    metrics.record(IterationStats(0.01, prefix_cache_queries=40, prefix_cache_hits=0))
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    assert samples["moeserve:prefix_cache_queries_total"] == 340
    assert samples["moeserve:prefix_cache_hits_total"] == 256


def test_merge_interleaves_and_propagates_errors() -> None:
    async def numbers(start: int, fail: bool = False):
        for i in range(start, start + 3):
            await asyncio.sleep(0)
            yield i
        if fail:
            raise RuntimeError("boom")

    async def collect(*streams):
        return [item async for item in merge(list(streams))]

    items = asyncio.run(collect(numbers(0), numbers(10)))
    assert sorted(items) == [(0, 0), (0, 1), (0, 2), (1, 10), (1, 11), (1, 12)]
    assert [v for i, v in items if i == 1] == [10, 11, 12]  # each stream's order is kept
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(collect(numbers(0), numbers(10, fail=True)))


@pytest.mark.parametrize(
    "text, expected",
    [("4096", 4096), ("512MiB", 512 * 1024**2), ("2GiB", 2 * 1024**3), ("1.5KiB", 1536), ("3MB", 3_000_000)],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")


def test_app_before_the_model_is_loaded() -> None:
    """The server listens while loading: /health is 503 and requests get a 503 saying why."""
    from fastapi.testclient import TestClient

    from moeserve.api import ServerSettings, ServingState, build_app

    state = ServingState(ServerSettings(served_model_name="m"), ServerMetrics("m", SLOConfig()))
    http = TestClient(build_app(state))
    assert http.get("/health").status_code == 503
    response = http.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert response.status_code == 503 and "loading" in response.json()["error"]["message"]
    assert http.get("/metrics").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == "m"


def test_batch_histogram_exposes_what_prometheus_histogram_does() -> None:
    """Same buckets (values on an edge count in it), count and sum; only `_created` differs."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from moeserve.api.metrics import BatchHistogram

    buckets = (0.005, 0.01, 0.02, 0.5)
    values = [0.0, 0.005, 0.0051, 0.01, 0.019, 0.02, 0.3, 0.5, 0.51, 7.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch = BatchHistogram("moeserve:x_seconds", "Doc.", buckets, "m", ours)
    batch.observe_many(values[:4])
    batch.observe_many([])
    batch.observe_many(values[4:])
    reference = Histogram("moeserve:x_seconds", "Doc.", ["model_name"], buckets=buckets, registry=theirs).labels("m")
    for value in values:
        reference.observe(value)

    def lines(registry: CollectorRegistry) -> list[str]:
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)
    assert 'moeserve:x_seconds_bucket{le="0.005",model_name="m"} 2.0' in lines(ours)


def test_expert_series_are_aggregated_unless_asked_for() -> None:
    """By default a model's hundreds of experts and dozens of layers make a handful of series;
    per expert and per layer only with `per_expert`."""
    routed = RoutedTokens([[5, 1], [2, 2]], [[5, 1], [2, 2]], (1, 3))  # two layers, two ranks of one expert each

    def samples(metrics: ServerMetrics) -> dict[str, float]:
        metrics.record(IterationStats(0.01, routed_tokens=routed))
        found = {}
        for family in text_string_to_metric_families(metrics.exposition().decode()):
            if family.name in ("moeserve:expert_routed_tokens", "moeserve:expert_load_imbalance"):
                for s in family.samples:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                    found[f"{s.name}{{{labels}}}"] = s.value
        return found

    assert samples(ServerMetrics("m", SLOConfig(), imbalance_min_rows=0)) == {
        "moeserve:expert_routed_tokens_total{}": 10,
        "moeserve:expert_load_imbalance{over=mean}": (5 / 3 + 1.0) / 2,
        "moeserve:expert_load_imbalance{over=worst}": 5 / 3,
    }
    assert samples(ServerMetrics("m", SLOConfig(), imbalance_min_rows=0, per_expert=True)) == {
        "moeserve:expert_routed_tokens_total{expert=0}": 7,
        "moeserve:expert_routed_tokens_total{expert=1}": 3,
        "moeserve:expert_load_imbalance{layer=1}": 5 / 3,
        "moeserve:expert_load_imbalance{layer=3}": 1.0,
    }


def test_metrics_have_no_created_series() -> None:
    metrics = ServerMetrics("m", SLOConfig())
    metrics.record(IterationStats(0.01, 7, 3))
    text = metrics.exposition().decode()
    assert "moeserve:generation_tokens_total" in text and "_created" not in text
