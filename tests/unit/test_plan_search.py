"""The planner's serving model and layout search, on cases whose answer is known by hand."""

from __future__ import annotations

import dataclasses

import pytest

from moeserve.plan.cost import Layout
from moeserve.plan.hardware import Hardware
from moeserve.plan.search import SearchSpace, deployments, screen, search
from moeserve.plan.serving import Deployment, Workload, capacity, fits, serve, simulate_rank
from moeserve.plan.shapes import load_shape


class FixedSteps:
    """Every step takes 10 ms, whatever it holds."""

    def seconds(self, decode: int, prefill: int) -> float:
        return 0.01


def test_mtp_tokens_per_step():
    assert Workload().tokens_per_step == 1.0
    assert Workload(mtp_drafts=2, mtp_acceptance=0.5).tokens_per_step == pytest.approx(1.75)


def test_one_request_prefills_then_decodes_a_token_a_step():
    run = simulate_rank(FixedSteps(), [0.0], max_batch=4, chunk=100, prompt=100, output=5, tokens_per_step=1.0)
    assert run.ttft == [pytest.approx(0.01)]
    assert run.worst_tbt == [pytest.approx(0.01)]
    assert run.duration_s == pytest.approx(0.05)
    assert run.output_tokens == 5


def test_chunked_prefill_takes_ceil_isl_over_chunk_steps():
    run = simulate_rank(FixedSteps(), [0.0], max_batch=4, chunk=100, prompt=250, output=2, tokens_per_step=1.0)
    assert run.ttft == [pytest.approx(0.03)]


def test_the_batch_cap_queues_the_second_request():
    run = simulate_rank(FixedSteps(), [0.0, 0.0], max_batch=1, chunk=100, prompt=10, output=3, tokens_per_step=1.0)
    assert sorted(run.ttft) == [pytest.approx(0.01), pytest.approx(0.04)]


def test_a_prefill_rank_hands_over_and_a_decode_rank_starts_from_a_cached_prompt():
    prefill = simulate_rank(FixedSteps(), [0.0], max_batch=8, chunk=50, prompt=100, output=1, tokens_per_step=1.0)
    assert prefill.ttft == [pytest.approx(0.02)]
    decode = simulate_rank(FixedSteps(), [0.0], max_batch=8, chunk=0, prompt=0, output=4, tokens_per_step=1.0)
    assert decode.duration_s == pytest.approx(0.04)


def test_serving_one_gpu_meets_loose_slos_at_90_percent_load():
    shape, hw = load_shape("qwen3-30b-a3b"), Hardware.of("h100")
    dep = Deployment(Layout(), 1, max_batch=32, chunk=512)
    workload = Workload(isl=512, osl=128, requests=60)
    assert fits(shape, hw, dep, workload)
    result = serve(shape, hw, dep, workload, slo_ttft_s=10.0, slo_tbt_s=1.0)
    assert result.rate == pytest.approx(0.9 * capacity(shape, hw, dep, workload))
    assert result.attainment == 1.0
    assert result.goodput_tok_s_per_gpu == result.tok_s_per_gpu > 0
    strict = serve(shape, hw, dep, workload, slo_ttft_s=1e-4, slo_tbt_s=1.0)
    assert strict.attainment == 0.0 and strict.goodput_tok_s_per_gpu == 0.0


def test_search_space_covers_colocated_and_split_layouts():
    shape = load_shape("qwen3-30b-a3b")
    deps = deployments(shape, SearchSpace(gpus=4, batch_caps=(32,), chunks=(512,)))
    colocated = {(d.decode.ep, d.decode.tp, d.decode.tbo) for d in deps if d.prefill is None}
    assert (4, 1, True) in colocated and (4, 4, False) in colocated and (1, 1, False) in colocated
    assert all(d.gpus == 4 for d in deps)
    assert any(d.prefill is not None and d.prefill_instances * d.prefill.ep == 1 for d in deps)


def test_without_a_fast_interconnect_the_best_layout_is_one_gpu_per_replica():
    """Known answer: with links this slow any EP or TP step is dominated by its all-to-all or
    all-reduce, so the model that fits one GPU is best served as independent single-GPU replicas."""
    shape = load_shape("qwen3-30b-a3b")
    slow = dataclasses.replace(Hardware.of("h100"), nvlink_bw=1e6, nic_bw=1e6)
    space = SearchSpace(gpus=8, batch_caps=(16, 64), chunks=(512,), simulate=4)
    workload = Workload(isl=512, osl=128, requests=60)
    results = search(shape, slow, space, workload, slo_ttft_s=5.0, slo_tbt_s=0.2)
    best = results[0].deployment
    assert (best.decode.ep, best.decode.tp) == (1, 1)
    assert best.prefill is None or (best.prefill.ep, best.prefill.tp) == (1, 1)


def test_a_model_that_does_not_fit_is_never_offered():
    shape, hw = load_shape("deepseek-v3"), Hardware.of("h100")
    candidates = screen(shape, hw, SearchSpace(gpus=8, batch_caps=(16,), chunks=(512,)), Workload(), 1.0)
    assert candidates == []
