"""Live rebalancing in the real multi-process engine, on a router skewed like real ones.

16 requests generate together at ep=4 with R = E/4 redundant experts; every few steps the ranks
rebalance (loads summed over the group, the balancer, expert weights sent rank to rank) in the
middle of generation. The greedy tokens must equal the single process's, and the rows each rank
received, as /metrics counts them, must be near even after the first rebalance where the
contiguous placement would have left them far apart.
"""

from __future__ import annotations

from statistics import mean

import pytest
import torch
from helpers.skewed_router import skew_router

import moeserve.engine.core as engine_core
from moeserve import LLM, SamplingParams
from moeserve.api.metrics import ServerMetrics
from moeserve.config import SLOConfig
from moeserve.dispatch import ExpertMap
from moeserve.eplb import imbalance

NUM_EXPERTS = 32
ENGINE = dict(max_model_len=96, block_size=8, kv_cache_blocks=160)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 30, (16,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, 300, (k,), generator=g).tolist()} for k in lengths]


class RoutingLog:
    """Every step's routed rows (the engine is made to report them each step), each tagged with
    how many rebalances rank 0 had reported by then, and the server's /metrics imbalance gauge
    (mean over MoE layers) after the step was recorded into it."""

    def __init__(self, moe_layers: tuple[int, ...]) -> None:
        self.executor = None
        # a gauge value per report, per layer
        self.metrics = ServerMetrics("m", SLOConfig(), imbalance_min_rows=0, per_expert=True)
        self.moe_layers = moe_layers
        self.steps: list[tuple[int, object, float]] = []

    def record(self, stats) -> None:
        self.metrics.record(stats)
        if stats.routed_tokens is not None and self.executor is not None:
            gauge = [
                self.metrics.registry.get_sample_value(
                    "moeserve:expert_load_imbalance", {"model_name": "m", "layer": str(i)}
                )
                for i in self.moe_layers
            ]
            self.steps.append((len(self.executor.rebalances), stats.routed_tokens, sum(gauge) / len(gauge)))


def rank_imbalance(rows: list[list[int]]) -> float:
    """Mean over MoE layers of max / mean of the ranks' rows."""
    return sum(max(layer) * len(layer) / sum(layer) for layer in rows) / len(rows)


def summed(reports, field: str) -> list[list[int]]:
    tables = [getattr(r, field) for r in reports]
    return [[sum(column) for column in zip(*(t[i] for t in tables))] for i in range(len(tables[0]))]


@pytest.mark.parametrize("ep", [4])
def test_live_rebalance_keeps_greedy_tokens_and_evens_the_load(make_checkpoint, tmp_path, monkeypatch, ep):
    base = make_checkpoint(
        "deepseek_v3",
        3,
        n_routed_experts=NUM_EXPERTS,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        num_hidden_layers=3,
    )
    folder = str(skew_router(base, tmp_path / "skewed", strength=0.3))
    with LLM(folder, **ENGINE) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]

    monkeypatch.setattr(engine_core, "ROUTING_INTERVAL_S", 0.0)
    log = RoutingLog(moe_layers=(1, 2))
    # Admission on (it refuses nothing here) runs the start-up step profile: its steps route
    # tokens too, which must count neither in the load reports nor as EPLB steps.
    options = dict(ENGINE, ep=ep, num_redundant_experts=NUM_EXPERTS // 4, enable_eplb=True, slo_admission="degrade")
    with LLM(folder, stat_loggers=[log], eplb_window_steps=12, eplb_interval_steps=12, **options) as llm:
        log.executor = llm.engine.executor
        outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        rebalances = list(llm.engine.executor.rebalances)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)

    assert len(rebalances) >= 2, "rebalances happen in the middle of generation"
    # Measured over many steps: a decode step routes only 16 x 3 pairs per layer, so one step's
    # split over four ranks is mostly noise.
    first = rebalances[0]
    assert log.steps[0][0] == 0, "no rebalance before the first served step: the profile's steps do not count"
    assert first.step == 12 and first.bytes_moved > 0 and first.experts_moved > 0
    assert first.imbalance_after[0] < first.imbalance_before[0]

    after = [routed for seen, routed, _ in log.steps if seen >= 1][1:]  # skip the step of the swap
    loads = summed([routed for _, routed, _ in log.steps], "counts")
    fed = sum(len(p["prompt_token_ids"]) for p in prompts()) + len(outputs) * (GREEDY.max_tokens - 1)
    assert [sum(layer) for layer in loads] == [3 * fed] * len(loads), "every served token's pairs, none else"
    contiguous = imbalance(ExpertMap.default(NUM_EXPERTS, 0, ep, len(loads)), loads)[0]
    measured = rank_imbalance(summed(after, "rank_rows"))
    print(
        f"ep={ep}: contiguous {contiguous:.3f}, measured after the first rebalance {measured:.3f}; {first.describe()}"
    )
    assert contiguous > 1.3
    assert measured <= 1.15
    gauge_before = [g for seen, _, g in log.steps if seen == 0]
    gauge_after = [g for seen, _, g in log.steps if seen >= 1][1:]
    print(f"/metrics imbalance gauge, mean per step: {mean(gauge_before):.3f} before, {mean(gauge_after):.3f} after")
    assert mean(gauge_after) < mean(gauge_before) - 0.1
    # The all-to-all counters: every pair counted once as a dispatched row (rank to rank), and
    # /metrics shows the bytes that left each rank.
    reports = [routed for _, routed, _ in log.steps]
    assert sum(sum(map(sum, r.wire.rows)) for r in reports) == sum(sum(map(sum, r.counts)) for r in reports)
    sample = log.metrics.registry.get_sample_value
    sent = [sample("moeserve:ep_dispatch_bytes_total", {"model_name": "m", "rank": str(r)}) for r in range(ep)]
    assert all(sent) and sent == [sum(r.wire.dispatch_bytes(rank) for r in reports) for rank in range(ep)]
    # One node: every rank in one NVLink domain, so all of it is intra-domain, none crosses a NIC.
    by_link = {
        link: [sample("moeserve:ep_dispatch_link_bytes_total", {"model_name": "m", "rank": str(r), "link": link})
               for r in range(ep)]
        for link in ("intra_domain", "inter_domain")
    }  # fmt: skip
    assert by_link == {"intra_domain": sent, "inter_domain": [0.0] * ep}
