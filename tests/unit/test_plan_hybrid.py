"""The planner on Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE): their shapes, the DeltaNet's
cost terms by hand, their memory against the engine's own sizing, and plans end to end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.hf_configs import hf_config

from moeserve.cli import main
from moeserve.engine_config import EngineConfig
from moeserve.models.architectures import resolve_architecture
from moeserve.models.decoder import cache_specs
from moeserve.plan.cost import (
    Layout,
    Work,
    attention_core,
    deltanet_core,
    deltanet_proj,
    kv_bytes_per_token,
    max_tokens_in_cache,
    state_bytes_per_gpu,
    step_cost,
    weight_bytes_per_gpu,
)
from moeserve.plan.hardware import Hardware
from moeserve.plan.search import SearchSpace, layouts, search
from moeserve.plan.serving import Deployment, StepTimes, Workload, fits
from moeserve.plan.shapes import load_config, load_shape, shape_of
from moeserve.worker.kv_cache import state_bytes

H100_HBM = 3.35e12 * 0.8
H100_FP32 = 67e12 * 0.5
H100_TF32 = 989e12 * 0.6 / 2


@pytest.fixture(scope="module")
def qwen35():
    return load_config("qwen3.5-35b-a3b")[0]


@pytest.fixture(scope="module")
def h100():
    return Hardware.of("h100")


def tiny_qwen35():
    """Transformers' tiny Qwen3.5-MoE of the tests: 4 layers (3 DeltaNets, then attention), 2 key
    heads of 8, 4 value heads of 12."""
    raw = hf_config("qwen3_5_moe", architectures=["Qwen3_5MoeForCausalLM"]).to_dict()
    return shape_of(resolve_architecture(raw)[1], "tiny")


def only(hw: Hardware, bound: str) -> Hardware:
    """`hw` with every rate but the FLOPs (bound "flops") or the bandwidth ("bytes") infinite, so a
    term's time is its FLOPs or its bytes over the figure left."""
    if bound == "bytes":
        return dataclasses.replace(hw, fp32_flops=math.inf, attention_flops=math.inf, bf16_flops=math.inf)
    return dataclasses.replace(hw, hbm_bw=math.inf)


def test_qwen3_5_shape_by_hand(qwen35):
    """The released Qwen3.5-35B-A3B: 30 DeltaNets (16 key heads, 32 value heads, 128 wide, conv of
    4) and 10 gated attention layers (16 query heads of 256 with a gate each, 2 KV heads)."""
    shape = shape_of(qwen35, "qwen3.5")
    channels = 2 * 16 * 128 + 32 * 128  # q, k, v
    assert (shape.linear_layers, shape.attention_layers, shape.moe_layers) == (30, 10, 40)
    assert shape.linear_in_params == 2048 * (channels + 32 * 128 + 2 * 32)  # qkv, z, b, a
    assert shape.linear_out_params == 32 * 128 * 2048
    assert shape.linear_conv_params == channels * 4
    assert shape.linear_state_bytes == 32 * 128 * 128 * 4
    assert shape.state_bytes == 30 * (channels * 3 * 2 + 32 * 128 * 128 * 4)
    assert shape.attn_params == 2048 * (2 * 16 * 256 + 2 * 2 * 256) + 16 * 256 * 2048
    assert shape.kv_bytes == 2 * 2 * 2 * 256
    bf16 = 10 * shape.attn_params + 30 * shape.linear_out_params + 40 * 3 * 2048 * 512  # with the shared experts
    bf16 += 30 * (shape.linear_in_params + shape.linear_conv_params) + 40 * 32 * 3 * 2048 * 512  # 256 / 8 experts
    assert weight_bytes_per_gpu(shape, Layout(ep=8)) == 2 * bf16 + 2 * 248320 * 2048 * 2


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kv_bytes_per_token_are_the_specs_paged_bytes(qwen35, tp):
    """Only the attention layers' KV per token, as the engine's specs count it on a TP rank (KV
    heads replicated past 2)."""
    layout = Layout(ep=tp, tp=tp)
    expected = cache_specs(qwen35, torch.bfloat16, tp).bytes_per_context_token
    assert kv_bytes_per_token(shape_of(qwen35, "q"), layout) == expected
    assert expected == 10 * 2 * 2 * 256 * 2 / min(tp, 2)


@pytest.mark.parametrize(("tp", "drafts"), [(1, 0), (2, 0), (4, 2)])
def test_the_states_set_aside_are_the_engines(qwen35, tp, drafts):
    """The slots, MTP draft states and default saved states the engine budgets for `max_num_seqs`
    sequences (`worker.kv_cache.state_bytes`), split over TP as its specs split them."""
    engine = EngineConfig(
        max_num_seqs=64,
        speculative_config={"method": "mtp", "num_speculative_tokens": drafts} if drafts else None,
    )
    workload = Workload(mtp_drafts=drafts)
    assert workload.draft_states == engine.draft_states
    shape, layout = shape_of(qwen35, "q"), Layout(ep=tp, tp=tp)
    set_aside = state_bytes(qwen35, torch.bfloat16, 64, tp, engine.draft_states, engine.num_saved_states)
    assert state_bytes_per_gpu(shape, layout, 64, workload.draft_states) == set_aside
    free = 141e9 * 0.9 - weight_bytes_per_gpu(shape, layout) - set_aside
    assert free > 0
    held = max_tokens_in_cache(shape, Hardware.of("h200"), layout, sequences=64, draft_states=engine.draft_states)
    assert held == pytest.approx(free / kv_bytes_per_token(shape, layout))


def test_a_batch_whose_states_do_not_fit_is_refused(qwen35, h100):
    """Short requests whose KV fits easily: with MTP's draft states (4 states a sequence, 61.4 MiB
    each) 256 sequences no longer fit EP2's free memory; without them they do."""
    shape, layout = shape_of(qwen35, "q"), Layout(ep=2)
    dep, short = Deployment(layout, 1, max_batch=256, chunk=512), Workload(isl=64, osl=64)
    assert max_tokens_in_cache(shape, h100, layout) > 10 * 256 * 128
    assert fits(shape, h100, dep, short)
    assert not fits(shape, h100, dep, dataclasses.replace(short, mtp_drafts=1))


def test_decode_recurrent_update_by_hand(h100):
    """Per token and value head 7 Dk Dv FLOPs; per sequence the float32 state read and written,
    with MTP the state after each verified token too and a restore for the share that rejected."""
    shape = tiny_qwen35()
    state = 4 * 8 * 12 * 4
    assert shape.linear_state_bytes == state
    work = Work(decode_tokens=8, decode_ctx=100)
    by_hand = max(8 * 4 * 7 * 8 * 12 / H100_FP32, 8 * 2 * state / H100_HBM)
    assert deltanet_core(shape, h100, Layout(), work) == pytest.approx(by_hand)
    flops = deltanet_core(shape, only(h100, "flops"), Layout(), work) * H100_FP32
    assert flops == pytest.approx(8 * 4 * 7 * 8 * 12)
    assert deltanet_core(shape, only(h100, "flops"), Layout(ep=2, tp=2), work) * H100_FP32 == pytest.approx(flops / 2)
    mtp = Work(decode_tokens=3 * 8, decode_ctx=100, decode_queries=3, decode_restores=0.5)
    nbytes = deltanet_core(shape, only(h100, "bytes"), Layout(), mtp) * H100_HBM
    assert nbytes == pytest.approx(8 * (2 + 3 + 2 * 0.5) * state)
    assert deltanet_core(shape, only(h100, "bytes"), Layout(ep=2, tp=2), mtp) * H100_HBM == pytest.approx(nbytes / 2)


def test_a_simulated_step_prices_its_prompts_and_restores(qwen35, h100):
    """A chunk of 2048 tokens of 1024-token prompts spans 3 prompts on average; with 2 drafts at
    acceptance 0.5, 3/4 of the decoding sequences restore a kept state first."""
    shape = shape_of(qwen35, "q")
    workload = Workload(isl=1024, osl=256, mtp_drafts=2, mtp_acceptance=0.5)
    cost = StepTimes(shape, h100, Layout(), workload).cost(8, 2048)
    work = Work(24, 1024 + 128, 2048, 512, decode_queries=3, decode_restores=0.75, prefill_seqs=3)
    assert cost.terms["deltanet_core"] == pytest.approx(30 * deltanet_core(shape, h100, Layout(), work))


def test_chunked_prefill_by_hand(h100):
    """Chunks of 32, values in programs of 32: per token and value head 6 Dk Dv against the state,
    2 C Dk for k k^T and for each program's q k^T, 4 C Dv within the chunk (tf32), and 4 C (C - 1)
    of triangular solve (float32); each prompt's state read and written once."""
    shape = tiny_qwen35()
    work = Work(prefill_tokens=64, prefill_ctx=32, prefill_seqs=2)
    tensor = 64 * 4 * (6 * 8 * 12 + 2 * 32 * 8 * 2 + 4 * 32 * 12)
    solve = 64 * 4 * 4 * 32 * 31
    by_flops = deltanet_core(shape, only(h100, "flops"), Layout(), work)
    assert by_flops == pytest.approx(tensor / H100_TF32 + solve / H100_FP32)
    by_bytes = deltanet_core(shape, dataclasses.replace(only(h100, "bytes"), fp32_flops=math.inf), Layout(), work)
    assert by_bytes == pytest.approx(2 * 2 * 4 * 8 * 12 * 4 / H100_HBM)
    assert deltanet_core(shape, h100, Layout(), Work()) == 0.0


def test_the_chunk_sizes_are_the_kernels():
    pytest.importorskip("triton")
    from moeserve.kernels import chunk_delta
    from moeserve.plan.cost import DELTA_BLOCK_V, DELTA_CHUNK

    assert (DELTA_CHUNK, DELTA_BLOCK_V) == (chunk_delta.CHUNK, chunk_delta.BLOCK_V)


def test_projections_split_over_tp_and_in_projections_stay_bf16(qwen35, h100):
    """At one token a weight read: the in-projections' bf16 bytes and out_proj's, both over TP; a
    block-FP8 release keeps the in-projections bf16 (dequantized at load) and out_proj FP8."""
    from moeserve.config import BlockFP8Config

    shape = shape_of(qwen35, "q")
    one = Work(decode_tokens=1)
    weights = (shape.linear_in_params + shape.linear_out_params) * 2
    assert deltanet_proj(shape, h100, Layout(), one) == pytest.approx(weights / H100_HBM)
    assert deltanet_proj(shape, h100, Layout(ep=4, tp=4), one) == pytest.approx(weights / 4 / H100_HBM)
    fp8 = shape_of(dataclasses.replace(qwen35, weight_quant=BlockFP8Config()), "q-fp8")
    fp8_weights = shape.linear_in_params * 2 + shape.linear_out_params
    assert deltanet_proj(fp8, h100, Layout(), one) == pytest.approx(fp8_weights / H100_HBM)


def test_attention_terms_count_the_attention_layers_only(qwen35, h100):
    shape, work = shape_of(qwen35, "q"), Work(decode_tokens=32, decode_ctx=4096)
    terms = step_cost(shape, h100, Layout(), work).terms
    assert terms["attention_core"] == pytest.approx(10 * attention_core(shape, h100, Layout(), work))
    assert terms["deltanet_core"] == pytest.approx(30 * deltanet_core(shape, h100, Layout(), work))
    assert terms["deltanet_proj"] == pytest.approx(30 * deltanet_proj(shape, h100, Layout(), work))


def test_against_its_all_attention_twin(qwen35):
    """The same model with every layer full attention: at 128k of context the hybrid decodes
    faster (its states are a tenth of the twin's KV reads) and its cache holds 3x the tokens;
    at 512 tokens its states cost more than the KV it saves."""
    h200 = Hardware.of("h200")
    hybrid = shape_of(qwen35, "hybrid")
    twin = shape_of(dataclasses.replace(qwen35, linear_layers=(False,) * 40), "twin")
    assert (twin.linear_layers, twin.state_bytes) == (0, 0)
    long, short = Work(decode_tokens=16, decode_ctx=128 * 1024), Work(decode_tokens=64, decode_ctx=512)
    assert step_cost(hybrid, h200, Layout(), long).seconds < 0.5 * step_cost(twin, h200, Layout(), long).seconds
    assert step_cost(hybrid, h200, Layout(), short).seconds > step_cost(twin, h200, Layout(), short).seconds
    held, twin_held = (max_tokens_in_cache(s, h200, Layout(), sequences=16) for s in (hybrid, twin))
    assert held > 3 * twin_held > 0


def test_the_search_plans_qwen3_5(h100):
    shape = load_shape("qwen3.5-35b-a3b")
    space = SearchSpace(gpus=8, batch_caps=(32, 128), chunks=(512,), simulate=3)
    results = search(shape, h100, space, Workload(isl=1024, osl=256, requests=60), slo_ttft_s=2.0, slo_tbt_s=0.1)
    assert results and results[0].goodput_tok_s_per_gpu > 0
    assert all(r.deployment.decode.ep > 1 for r in results)  # 35B of bf16 weights and states: EP2 at least


def test_the_command_prints_a_plan_for_qwen3_5(capsys):
    assert main(["plan", "--model", "qwen3.5-35b-a3b", "--gpus", "8", "--no-disaggregate", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("qwen3.5-35b-a3b on 8 x h100")
    assert lines[1].split()[:3] == ["#", "layout", "batch"] and lines[2].split()[0] == "1"


def test_a_tiny_hybrid_checkpoint_folder_plans(tmp_path, h100):
    """A Qwen3-Next folder (DeltaNets and attention alternating; 2 key heads, so no TP 4)."""
    hf_config("qwen3_next", architectures=["Qwen3NextForCausalLM"]).save_pretrained(tmp_path)
    shape = load_shape(str(tmp_path))
    assert (shape.linear_layers, shape.attention_layers, shape.linear_key_heads) == (2, 2, 2)
    assert {layout.tp for layout in layouts(shape, SearchSpace(gpus=4), 4)} == {1, 2}
    space = SearchSpace(gpus=2, batch_caps=(16,), chunks=(128,), simulate=2)
    results = search(shape, h100, space, Workload(isl=128, osl=32, requests=30), slo_ttft_s=1.0, slo_tbt_s=0.1)
    assert results and results[0].attainment == 1.0
