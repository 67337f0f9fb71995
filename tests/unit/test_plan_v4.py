"""The planner on DeepSeek-V4: its shape by hand, its attention (window, CSA with its indexer,
HCA) and hyper-connections by hand, its memory against the engine's own sizing, what
compression buys against DeepSeek-V3 at long context, and plans end to end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.hf_configs import hf_config

from moeserve.cli import main
from moeserve.engine_config import EngineConfig
from moeserve.models.decoder import cache_specs
from moeserve.plan.cost import (
    HYPER_STREAM_PASSES,
    Layout,
    Work,
    attention_core,
    attention_proj,
    compressed_attention,
    compressed_indexer,
    hyper_connections,
    kv_bytes_per_token,
    max_tokens_in_cache,
    state_bytes_per_gpu,
    step_cost,
    tp_allreduce,
    weight_bytes_per_gpu,
)
from moeserve.plan.hardware import Hardware
from moeserve.plan.search import SearchSpace, search
from moeserve.plan.serving import Workload
from moeserve.plan.shapes import BLOCK_SIZE, load_config, load_shape, shape_of
from moeserve.worker.kv_cache import context_blocks, state_bytes


@pytest.fixture(scope="module")
def flash():
    return load_config("deepseek-v4-flash")[0]


@pytest.fixture(scope="module")
def h200():
    return Hardware.of("h200")


def only(hw: Hardware, bound: str) -> Hardware:
    """`hw` with every rate but the FLOPs ("flops") or the bandwidth ("bytes") infinite."""
    if bound == "bytes":
        return dataclasses.replace(
            hw, fp32_flops=math.inf, attention_flops=math.inf, bf16_flops=math.inf, fp8_flops=math.inf
        )
    return dataclasses.replace(hw, hbm_bw=math.inf)


def test_flash_shape_by_hand(flash):
    """43 layers: 2 window only, 21 CSA (ratio 4, top 512 of 64 indexer heads of 128), 20 HCA
    (ratio 128); 64 heads of one shared 512-wide key; q lora 1024, 8 output groups of 1024."""
    shape = shape_of(flash, "flash")
    window, csa, hca = shape.compressed_kinds
    assert (window.ratio, window.layers, csa.ratio, csa.layers, hca.ratio, hca.layers) == (0, 2, 4, 21, 128, 20)
    assert (csa.topk, hca.topk, shape.window, shape.heads, shape.head_dim) == (512, 0, 128, 64, 512)
    assert shape.kv_bytes == csa.entry_bytes == hca.entry_bytes == 512 * 2
    assert csa.index_key_bytes == 128 * 2 and csa.index_ctx_flops == 64 * (2 * 128 + 2)
    assert csa.compressor_params == 2 * 4096 * 2 * 512 + 2 * 4096 * 2 * 128 + 1024 * 64 * 128 + 4096 * 64
    assert hca.compressor_params == 2 * 4096 * 512 and window.compressor_params == 0
    assert shape.attn_params == 4096 * 1024 + 1024 * 64 * 512 + 4096 * 512 + 8 * 1024 * 4096
    assert shape.grouped_out_params == 8 * (64 * 512 // 8) * 1024
    assert (shape.hyper_streams, shape.hyper_params) == (4, 2 * (2 + 4) * 4 * 4 * 4096)
    assert shape.attn_ctx_flops == shape.prefill_ctx_flops == 4 * 64 * 512
    # open windows: CSA's pending rows (3 of 2 x 512 values and gates) and carry (4 x 512, bf16 and
    # float32), its indexer's alike at 128; HCA's pending rows (127 of 512 values and gates)
    csa_state = 3 * 1024 * 2 * 2 + 4 * 512 * (2 + 4) + 3 * 256 * 2 * 2 + 4 * 128 * (2 + 4)
    assert shape.state_bytes == 21 * csa_state + 20 * 127 * 512 * 2 * 2
    assert (shape.expert_weight_bytes, shape.dense_weight_bytes, shape.fp8_experts) == (4.25 / 8, 1.0, False)
    fp8 = 43 * shape.attn_params + 21 * csa.compressor_params + 20 * hca.compressor_params + 43 * 3 * 4096 * 2048
    attention = fp8 + 43 * (shape.grouped_out_params * 2 + shape.hyper_params * 4)  # wo_a bf16, mixers float32
    routed = 43 * 32 * 3 * 4096 * 2048 * 4.25 / 8  # 256 / 8 MXFP4 experts
    assert weight_bytes_per_gpu(shape, Layout(ep=8)) == pytest.approx(attention + routed + 2 * 129280 * 4096 * 2)


def test_decode_attention_by_hand_past_the_window(flash, h200):
    """8 decodes at 64k: every layer's 128 window keys; CSA 512 of its 16384 entries, which its
    indexer scores all of; HCA all 512 of its entries. Each key 4 Hq D FLOPs per query, read
    once per sequence."""
    shape = shape_of(flash, "flash")
    window, csa, hca = shape.compressed_kinds
    work, per_key = Work(decode_tokens=8, decode_ctx=64 * 1024), 4 * 64 * 512
    flops, nbytes = only(h200, "flops"), only(h200, "bytes")
    for kind, keys in ((window, 128), (csa, 128 + 512), (hca, 128 + 512)):
        assert compressed_attention(shape, kind, flops, work) * h200.attention_flops == pytest.approx(
            8 * keys * per_key
        )
        assert compressed_attention(shape, kind, nbytes, work) * h200.hbm_bw == pytest.approx(8 * keys * 1024)
    assert compressed_indexer(csa, flops, work) * h200.attention_flops == pytest.approx(8 * 16384 * 64 * 258)
    assert compressed_indexer(csa, nbytes, work) * h200.hbm_bw == pytest.approx(8 * 16384 * 256)
    assert compressed_indexer(hca, h200, work) == compressed_indexer(window, h200, work) == 0.0
    by_kind = sum(
        k.layers * (compressed_attention(shape, k, h200, work) + compressed_indexer(k, h200, work))
        for k in shape.compressed_kinds
    )
    assert step_cost(shape, h200, Layout(), work).terms["attention_core"] == pytest.approx(by_kind)


def test_projections_at_one_token_are_a_weight_read(flash, h200):
    """q's low-rank path, the shared key, wo_b and the mean layer's compressors in FP8, the
    grouped wo_a in bf16 (dequantized at load)."""
    shape = shape_of(flash, "flash")
    _, csa, hca = shape.compressed_kinds
    compressors = (21 * csa.compressor_params + 20 * hca.compressor_params) / 43
    nbytes = shape.attn_params + compressors + 2 * shape.grouped_out_params
    assert attention_proj(shape, only(h200, "bytes"), Layout(), Work(decode_tokens=1)) * h200.hbm_bw == pytest.approx(
        nbytes
    )


def test_attention_is_replicated_over_tp(flash, h200):
    """Every rank of a TP group runs V4's whole attention and holds its weights and cache; the
    MoE's outputs are all-gathered (half an all-reduce's bytes)."""
    shape, work = shape_of(flash, "flash"), Work(decode_tokens=64, decode_ctx=8192, prefill_tokens=512)
    one, four = Layout(ep=4), Layout(ep=4, tp=4)
    assert attention_core(shape, h200, four, work) == attention_core(shape, h200, one, work)
    assert attention_proj(shape, h200, four, work) == attention_proj(shape, h200, one, work)
    assert kv_bytes_per_token(shape, four) == kv_bytes_per_token(shape, one)
    assert state_bytes_per_gpu(shape, four, 16) == state_bytes_per_gpu(shape, one, 16)
    # nothing is sharded: the shared expert, like the routed ones, runs whole on a slice of the tokens
    assert weight_bytes_per_gpu(shape, four) == weight_bytes_per_gpu(shape, one)
    gather = 3 / 4 * work.tokens * 4096 * 2 / h200.nvlink_bw
    assert tp_allreduce(shape, h200, four, work) == pytest.approx(h200.allreduce_latency_s + gather)


def test_hyper_connections_by_hand(flash, h200):
    """Two mixers a layer: float32 projections of the 4 x 4096 streams to 24 weights each, and
    `HYPER_STREAM_PASSES` passes over the bf16 streams apiece."""
    shape, work = shape_of(flash, "flash"), Work(decode_tokens=1000)
    params = 2 * 24 * 4 * 4096
    assert hyper_connections(shape, only(h200, "flops"), work) * h200.fp32_flops == pytest.approx(2 * params * 1000)
    streams = 1000 * 2 * HYPER_STREAM_PASSES * 4 * 4096 * 2
    assert hyper_connections(shape, only(h200, "bytes"), work) * h200.hbm_bw == pytest.approx(params * 4 + streams)
    assert hyper_connections(load_shape("deepseek-v3"), h200, work) == 0.0


@pytest.mark.parametrize("drafts", [0, 2])
def test_the_memory_set_aside_is_the_engines(flash, h200, drafts):
    """States for max_num_seqs slots, as many saved ones and, with MTP, each verify step's kept
    inputs (`worker.kv_cache.state_bytes`); the windows' blocks and the context the rest buys
    (`worker.kv_cache.context_blocks`), the compressed groups' bytes per position of context."""
    engine = EngineConfig(
        max_num_seqs=64,
        speculative_config={"method": "mtp", "num_speculative_tokens": drafts} if drafts else None,
    )
    workload = Workload(mtp_drafts=drafts)
    assert workload.draft_states == engine.draft_states
    shape, layout, specs = shape_of(flash, "flash"), Layout(ep=8), cache_specs(flash, torch.bfloat16)
    set_aside = state_bytes(flash, torch.bfloat16, 64, 1, engine.draft_states, engine.num_saved_states)
    assert state_bytes_per_gpu(shape, layout, 64, workload.draft_states) == set_aside
    assert kv_bytes_per_token(shape, layout) == specs.bytes_per_context_token == 21 * 1280 / 4 + 20 * 1024 / 128
    budget = int(h200.gpu.hbm_bytes * 0.9 - weight_bytes_per_gpu(shape, layout)) - set_aside
    engine_tokens = context_blocks(specs, budget, BLOCK_SIZE, 64, 0, 1 << 40) * BLOCK_SIZE
    held = max_tokens_in_cache(shape, h200, layout, sequences=64, draft_states=workload.draft_states)
    assert held == pytest.approx(engine_tokens, rel=1e-5)


@pytest.mark.parametrize("tokens", [100, 4096, 128 * 1024])
def test_a_sequence_costs_what_its_blocks_cost(flash, tokens):
    """The planner's bytes for one sequence bound what the engine's block groups hold for it
    (`CacheSpecs.bytes_per_sequence`) from above, by at most the blocks set aside per sequence."""
    shape, specs = shape_of(flash, "flash"), cache_specs(flash, torch.bfloat16)
    planned = tokens * kv_bytes_per_token(shape, Layout()) + shape.sequence_block_bytes + shape.state_bytes
    held = specs.bytes_per_sequence(tokens, BLOCK_SIZE)
    assert held <= planned <= held + shape.sequence_block_bytes


def test_v4_reads_far_less_cache_than_v3_at_128k(flash, h200):
    """One decode at 128k: V3 reads its 61 layers' 1152-byte latents of every position (9.2 GB);
    V4 its windows, CSA's top 512 entries and indexer keys, HCA's 1024 entries (0.2 GB)."""
    work, nbytes = Work(decode_tokens=1, decode_ctx=128 * 1024), only(h200, "bytes")
    v3, v4 = load_shape("deepseek-v3"), shape_of(flash, "flash")
    v3_read = step_cost(v3, nbytes, Layout(), work).terms["attention_core"] * h200.hbm_bw
    v4_read = step_cost(v4, nbytes, Layout(), work).terms["attention_core"] * h200.hbm_bw
    assert v3_read == pytest.approx(61 * 128 * 1024 * 1152)
    assert v4_read < v3_read / 40
    window = 43 * 128 * 1024
    assert v4_read == pytest.approx(window + 21 * (512 * 1024 + 32768 * 256) + 20 * 1024 * 1024)


def test_the_search_plans_v4_flash(h200):
    shape = load_shape("deepseek-v4-flash")
    space = SearchSpace(gpus=8, batch_caps=(32, 128), chunks=(512,), simulate=3)
    results = search(shape, h200, space, Workload(isl=4096, osl=512, requests=60), slo_ttft_s=2.0, slo_tbt_s=0.1)
    assert results and results[0].goodput_tok_s_per_gpu > 0


def test_the_command_prints_a_plan_for_v4_flash(capsys):
    argv = ["plan", "--model", "deepseek-v4-flash", "--gpus", "8", "--gpu", "h200", "--no-disaggregate", "--top", "2"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("deepseek-v4-flash on 8 x h200")
    assert lines[1].split()[:3] == ["#", "layout", "batch"] and lines[2].split()[0] == "1"


def test_a_tiny_v4_checkpoint_folder_plans(tmp_path, h200):
    """Transformers' tiny V4 (window, CSA, HCA of 16, CSA; a window of 8) written to a folder."""
    hf_config("deepseek_v4", architectures=["DeepseekV4ForCausalLM"]).save_pretrained(tmp_path)
    shape = load_shape(str(tmp_path))
    assert [(k.ratio, k.layers) for k in shape.compressed_kinds] == [(0, 1), (4, 2), (16, 1)]
    assert shape.window == 8 and shape.state_bytes > 0
    space = SearchSpace(gpus=2, batch_caps=(16,), chunks=(128,), simulate=2)
    results = search(shape, h200, space, Workload(isl=128, osl=32, requests=30), slo_ttft_s=1.0, slo_tbt_s=0.1)
    assert results and results[0].attainment == 1.0
