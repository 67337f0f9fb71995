"""The planner's cost terms, each pinned to a value computed by hand from its formula."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from moeserve.dispatch.wire import ep_rows_per_token, tp_rows_per_token
from moeserve.plan.cost import (
    Layout,
    Work,
    active_experts,
    attention_core,
    attention_proj,
    combine,
    dispatch,
    experts,
    link_shares,
    max_tokens_in_cache,
    remote_domains_per_token,
    step_cost,
    tp_allreduce,
    weight_bytes_per_gpu,
)
from moeserve.plan.hardware import GPUS, Hardware
from moeserve.plan.shapes import known_models, load_shape

EP_VOLUME = Path(__file__).resolve().parents[2] / "bench" / "results" / "ep_volume.json"
H100_HBM = 3.35e12 * 0.8
H100_FP8 = 1979e12 * 0.7
H100_ATTN = 989e12 * 0.6


@pytest.fixture(scope="module")
def v3():
    return load_shape("deepseek-v3")


@pytest.fixture(scope="module")
def h100():
    return Hardware.of("h100")


def test_every_known_model_parses_through_the_servers_own_config_code():
    assert known_models() == [
        "deepseek-v3",
        "deepseek-v4-flash",
        "deepseek-v4-pro",
        "gpt-oss-120b",
        "mixtral-8x7b",
        "qwen3-235b-a22b",
        "qwen3-30b-a3b",
        "qwen3.5-35b-a3b",
    ]
    for name in known_models():
        assert load_shape(name).moe_layers > 0


def test_deepseek_v3_shapes_by_hand(v3):
    q = 7168 * 1536 + 1536 * 128 * 192
    kv = 7168 * (512 + 64) + 512 * 128 * (128 + 128)
    o = 128 * 128 * 7168
    assert v3.attn_params == q + kv + o == 187_105_280
    assert v3.kv_bytes == 2 * (512 + 64)
    assert v3.attn_ctx_flops == 2 * 128 * (2 * 512 + 64)
    assert (v3.moe_layers, v3.dense_layers, v3.expert_params) == (58, 3, 3 * 7168 * 2048)
    assert v3.fp8_experts and v3.dense_weight_bytes == 1.0


def test_gqa_and_mxfp4_shapes_by_hand():
    qwen = load_shape("qwen3-30b-a3b")
    assert qwen.attn_params == 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048
    assert qwen.kv_bytes == 2 * 2 * 4 * 128
    oss = load_shape("gpt-oss-120b")
    assert oss.expert_weight_bytes == pytest.approx(4.25 / 8)
    assert (oss.window_share, oss.window) == (0.5, 128)
    assert oss.kv_ctx(1000) == pytest.approx(0.5 * 1000 + 0.5 * 128)


def test_int4_and_nvfp4_experts_by_hand():
    """Kimi-K2.5's INT4 experts: a 4-bit code and a bf16 scale per 32 values; NVFP4: a 4-bit code
    and an e4m3 scale per 16; the dense layers stay bf16 in both."""
    from moeserve.config import NVFP4Config, PackedInt4Config
    from moeserve.models.architectures import resolve_architecture
    from moeserve.plan.shapes import CONFIGS, shape_of

    v3 = load_shape("deepseek-v3")
    config = resolve_architecture(json.loads((CONFIGS / "deepseek-v3.json").read_text()))[1]
    for quant in (PackedInt4Config(32), NVFP4Config()):
        shape = shape_of(dataclasses.replace(config, weight_quant=quant), "v3")
        assert shape.expert_weight_bytes == pytest.approx(4.5 / 8) and shape.dense_weight_bytes == 2.0
        assert not shape.fp8_experts and shape.expert_params == v3.expert_params


def test_hardware_is_peak_times_efficiency_until_measured(h100):
    assert h100.hbm_bw == pytest.approx(H100_HBM)
    assert h100.fp8_flops == pytest.approx(H100_FP8)
    assert h100.nic_bw == pytest.approx(50e9 * 0.8)
    assert set(h100.provenance().values()) == {"assumed"}
    measured = h100.with_measured(hbm_bw=3e12)
    assert measured.hbm_bw == 3e12 and measured.provenance()["hbm_bw"] == "measured"
    assert set(GPUS) == {"h100", "h800", "h200", "b200", "gb200"}


def test_attention_projection_is_a_weight_read_at_small_batch(v3, h100):
    t = attention_proj(v3, h100, Layout(), Work(decode_tokens=8))
    assert t == pytest.approx(187_105_280 * 1.0 / H100_HBM)
    assert attention_proj(v3, h100, Layout(ep=8, tp=8), Work(decode_tokens=8)) == pytest.approx(t / 8)


def test_mla_decode_attention_by_hand(v3, h100):
    t = attention_core(v3, h100, Layout(), Work(decode_tokens=8, decode_ctx=2000))
    flops = 8 * 2000 * 2 * 128 * (2 * 512 + 64)
    kv = 8 * 2000 * 1152
    assert t == pytest.approx(max(flops / H100_ATTN, kv / H100_HBM))
    # the latent is not split by TP: the KV read stays, the FLOPs divide
    t8 = attention_core(v3, h100, Layout(ep=8, tp=8), Work(decode_tokens=8, decode_ctx=2000))
    assert t8 == pytest.approx(max(flops / 8 / H100_ATTN, kv / H100_HBM))


def test_mla_prefill_attention_reads_the_kv_once_per_query_tile(v3, h100):
    """A 16k-token prefill step at a mean context of 1000: 128 heads x (192 + 128) dims of
    unabsorbed MLA per (query, key) pair against one read of the latent per 128 prompt tokens;
    compute bound, as a flash-style kernel runs it (every query reading the whole context would
    make it three times slower, and bandwidth bound)."""
    t = attention_core(v3, h100, Layout(), Work(prefill_tokens=16384, prefill_ctx=1000))
    flops = 16384 * 1000 * 2 * 128 * (192 + 128)
    kv = 16384 / 128 * 1000 * 1152
    assert t == pytest.approx(max(flops / H100_ATTN, kv / H100_HBM)) == pytest.approx(flops / H100_ATTN)


def test_mtp_queries_share_one_kv_read(v3, h100):
    """Four queries per sequence (3 drafts): FLOPs x4, the KV read once."""
    work = Work(decode_tokens=4 * 8, decode_ctx=2000, decode_queries=4)
    t = attention_core(v3, h100, Layout(), work)
    assert t == pytest.approx(max(32 * 2000 * 278_528 / H100_ATTN, 8 * 2000 * 1152 / H100_HBM))


def test_expert_gemm_memory_bound_then_compute_bound(v3, h100):
    layout = Layout(ep=8)
    one = Work(decode_tokens=1)  # per DP group: 8 groups, 8 tokens, 64 picks over 256 experts
    active = 32 * (1 - (1 - 1 / 256) ** 64)
    assert active_experts(v3, layout, one) == pytest.approx(active)
    assert experts(v3, h100, layout, one) == pytest.approx(active * 3 * 7168 * 2048 / H100_HBM)
    many = Work(decode_tokens=100_000)
    assert experts(v3, h100, layout, many) == pytest.approx(2 * 3 * 7168 * 2048 * 100_000 * 8 / H100_FP8)
    skewed = dataclasses.replace(layout, expert_imbalance=1.5)
    assert experts(v3, h100, skewed, many) == pytest.approx(1.5 * experts(v3, h100, layout, many))


def test_dispatch_and_combine_bytes_over_nvlink_and_nic_by_hand(v3):
    """DeepEP's low-latency setup: 128 tokens, top-8, hidden 7168, FP8 rows of 7168 + 56 scales."""
    h800 = Hardware.of("h800")
    work = Work(decode_tokens=128)
    nvl, nic = 200e9 * 0.8, 50e9 * 0.8
    ep8 = dispatch(v3, h800, Layout(ep=8), work)
    assert ep8 == pytest.approx(15e-6 + 128 * 8 * 7 / 8 * 7392 / nvl)
    ep32 = dispatch(v3, h800, Layout(ep=32), work)
    assert ep32 == pytest.approx(15e-6 + max(128 * 8 * 7 / 32 * 7392 / nvl, 128 * 8 * 24 / 32 * 7392 / nic))
    assert combine(v3, h800, Layout(ep=32), work) == pytest.approx(15e-6 + 128 * 8 * 24 / 32 * 7168 * 2 / nic)
    bf16 = dispatch(v3, h800, Layout(ep=32, dispatch_fp8=False), work)
    assert bf16 == pytest.approx(combine(v3, h800, Layout(ep=32), work))
    assert dispatch(v3, h800, Layout(), work) == 0.0


def test_link_shares_and_node_dedupe():
    assert link_shares(8, 8) == (1.0, 0.0)
    assert link_shares(32, 8) == pytest.approx((7 / 31, 24 / 31))
    assert link_shares(1, 8) == (0.0, 0.0)
    # 8 picks over 4 domains: each hit with 1 - (3/4)^8, three quarters of them remote
    assert remote_domains_per_token(8, 4) == pytest.approx(4 * (1 - 0.75**8) * 3 / 4)
    assert remote_domains_per_token(8, 1) == 0.0


def test_tp_vs_ep_volume_table_matches_the_measured_bench():
    """bench/ep_volume.py's formulas, per token and MoE layer, are the ones the planner prices."""
    rows = json.loads(EP_VOLUME.read_text())["rows"]
    top_k = json.loads(EP_VOLUME.read_text())["model"]["top_k"]
    for row in rows:
        n = row["ep"]
        assert ep_rows_per_token(top_k, n) == row["ep_formula"]
        assert tp_rows_per_token(n) == row["tp_formula"]
        # live routing stays within 10% of the uniform formula the planner assumes
        assert row["ep_live"] == pytest.approx(row["ep_formula"], rel=0.1)
    table = {n: (ep_rows_per_token(top_k, n), tp_rows_per_token(n)) for n in (2, 4, 8)}
    assert table == {2: (4.0, 2), 4: (6.0, 6), 8: (7.0, 14)}  # TP passes EP once N > K


def test_tp_allreduce_ring_bytes_by_hand(v3, h100):
    t = tp_allreduce(v3, h100, Layout(ep=8, tp=8), Work(decode_tokens=100))
    assert t == pytest.approx(10e-6 + 2 * 7 / 8 * 100 * 7168 * 2 / (450e9 * 0.8))
    assert tp_allreduce(v3, h100, Layout(ep=8), Work(decode_tokens=100)) == 0.0


def test_tp_shards_attention_and_runs_the_ffn_whole_on_a_token_slice(v3, h100):
    """At TP 8 a rank holds 1/8 of attention but the dense MLPs and the shared expert whole (they
    run on its eighth of the tokens): their FLOPs divide by 8, their weight read does not; one
    reduce-scatter and all-gather per layer, dense or MoE, an all-reduce's bytes."""
    one, eight = Layout(ep=8), Layout(ep=8, tp=8)
    attention = 61 * 187_105_280
    assert weight_bytes_per_gpu(v3, one) - weight_bytes_per_gpu(v3, eight) == pytest.approx(attention * 7 / 8)
    small = Work(decode_tokens=8, decode_ctx=2000)
    shared = 3 * 7168 * 2048  # FP8: a byte a weight
    assert step_cost(v3, only_bytes(h100), eight, small).terms["shared_expert"] * h100.hbm_bw == pytest.approx(
        58 * shared
    )
    big = Work(prefill_tokens=8192, prefill_ctx=1000)
    flops = step_cost(v3, dataclasses.replace(h100, hbm_bw=math.inf), eight, big).terms["dense_mlp"] * H100_FP8
    assert flops == pytest.approx(3 * 2 * 3 * 7168 * 18432 * 8192 / 8)
    cost = step_cost(v3, h100, eight, small)
    assert cost.terms["tp_allreduce"] == pytest.approx(61 * tp_allreduce(v3, h100, eight, small))


def only_bytes(hw: Hardware) -> Hardware:
    """`hw` with every FLOP rate infinite: a term's time is its bytes over the bandwidth."""
    return dataclasses.replace(hw, bf16_flops=math.inf, fp8_flops=math.inf, attention_flops=math.inf)


def test_two_batch_overlap_loses_on_weights_and_wins_on_communication(v3, h100):
    small, big = Work(decode_tokens=8, decode_ctx=2000), Work(decode_tokens=256, decode_ctx=2000)
    plain, tbo = Layout(ep=72), Layout(ep=72, tbo=True)
    assert step_cost(v3, h100, tbo, small).seconds > step_cost(v3, h100, plain, small).seconds
    assert step_cost(v3, h100, tbo, big).seconds < step_cost(v3, h100, plain, big).seconds
    no_sms = step_cost(v3, h100, tbo, big).terms["experts"]
    half_sms = step_cost(v3, h100, Layout(ep=72, tbo=True, num_comm_sms=66), big).terms["experts"]
    assert half_sms == pytest.approx(2 * no_sms)


def test_step_without_overlap_is_the_sum_of_its_terms(v3, h100):
    cost = step_cost(v3, h100, Layout(ep=16), Work(decode_tokens=64, decode_ctx=2000))
    assert cost.seconds == pytest.approx(math.fsum(cost.terms.values()))
    assert cost.dominant == "experts"


def test_weights_and_kv_capacity_by_hand(v3, h100):
    dense = 61 * 187_105_280 + 3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048
    routed = 58 * 16 * 3 * 7168 * 2048
    assert weight_bytes_per_gpu(v3, Layout(ep=16)) == dense + routed + 2 * 129280 * 7168 * 2
    # 256 experts over 12 ranks: the fullest holds 22
    assert weight_bytes_per_gpu(v3, Layout(ep=12)) - weight_bytes_per_gpu(v3, Layout(ep=16)) == 58 * 6 * 3 * 7168 * 2048
    assert max_tokens_in_cache(v3, h100, Layout(ep=8)) == 0.0  # 671B FP8 does not fit 8 x 80 GB
    free = 80e9 * 0.9 - weight_bytes_per_gpu(v3, Layout(ep=16))
    assert max_tokens_in_cache(v3, h100, Layout(ep=16)) == pytest.approx(free / (61 * 1152))


def test_layout_refuses_what_the_runtime_cannot_run():
    with pytest.raises(ValueError):
        Layout(ep=6, tp=4)
    with pytest.raises(ValueError):
        Layout(ep=8, expert_imbalance=0.9)


def test_dsa_decode_attention_is_the_sparse_cost_not_dense_mla(h100):
    """DeepSeek-V3.2 (DeepSeek-V3's shapes and its indexer: 64 heads of 128, top 2048) at 32k of
    context: the planner's decode attention, compute-bound and then memory-bound, sums to
    `plan.sparse_attention`'s FLOPs and bytes; the same shape without DSA costs dense MLA's."""
    from moeserve.models.architectures import resolve_architecture
    from moeserve.plan.cost import kv_bytes_per_token
    from moeserve.plan.shapes import CONFIGS, shape_of
    from moeserve.plan.sparse_attention import decode_attention_cost

    raw = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    raw |= {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}
    config = resolve_architecture(raw)[1]
    sparse, dense = shape_of(config, "v32"), shape_of(dataclasses.replace(config, dsa=None), "v3")
    work = Work(decode_tokens=1, decode_ctx=32768)
    compute_bound, memory_bound = (dataclasses.replace(h100, **{f: math.inf}) for f in ("hbm_bw", "attention_flops"))
    for shape, cost in (
        (sparse, decode_attention_cost(config, 32768)),
        (dense, decode_attention_cost(config, 32768, sparse=False)),
    ):
        flops = shape.layers * attention_core(shape, compute_bound, Layout(), work) * h100.attention_flops
        nbytes = shape.layers * attention_core(shape, memory_bound, Layout(), work) * h100.hbm_bw
        assert (flops, nbytes) == (pytest.approx(cost.flops), pytest.approx(cost.bytes))
    assert attention_core(sparse, h100, Layout(), work) < attention_core(dense, h100, Layout(), work) / 3
    # the cache holds each layer's indexer keys beside its latent
    assert (
        kv_bytes_per_token(sparse, Layout()) == 61 * (1152 + 256) and kv_bytes_per_token(dense, Layout()) == 61 * 1152
    )
