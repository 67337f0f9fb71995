"""The launches the compile check compiles: each case calls a kernel module's public wrapper (or
drives the `nvshmem` dispatcher) the way the runtime does, at the shapes of real checkpoints, with
token counts at the edges Triton specializes on (1, 16, and odd), so the check sees the very
grids and compile-time constants a GPU run would get. Everything runs under
`targets.compile_only`: kernels are compiled, never executed, and the host code around them runs
on whatever their outputs hold (uninitialised memory: no case reads a value back that matters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moeserve.config import GatedActivation
from moeserve.fp8_format import FP8_DTYPE, BlockFP8Weight
from moeserve.kernels.targets import compile_only

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Case:
    module: str  # the kernel module it launches (`--only` selects by it)
    name: str
    run: Callable[[], None]


@dataclass(frozen=True)
class MoEShape:
    """The MoE dimensions of a published checkpoint that the kernels specialize on."""

    name: str
    hidden: int
    intermediate: int  # per expert
    experts: int
    top_k: int
    ep: int  # the expert-parallel size it is served at


DEEPSEEK_V3 = MoEShape("DeepSeek-V3", hidden=7168, intermediate=2048, experts=256, top_k=8, ep=8)
QWEN3_235B = MoEShape("Qwen3-235B-A22B", hidden=4096, intermediate=1536, experts=128, top_k=8, ep=4)
MIXTRAL = MoEShape("Mixtral-8x7B", hidden=4096, intermediate=14336, experts=8, top_k=2, ep=2)
# transformers' DeepseekV4Config defaults (swiglu_limit 10, routed_scaling_factor 1.5)
DEEPSEEK_V4_FLASH = MoEShape("DeepSeek-V4-Flash", hidden=4096, intermediate=2048, experts=256, top_k=6, ep=8)
GPT_OSS_120B = MoEShape("gpt-oss-120b", hidden=2880, intermediate=2880, experts=128, top_k=4, ep=4)
EDGE_TOKENS = (1, 16, 17)  # Triton makes an int of 1 a constant and marks multiples of 16


@dataclass(frozen=True)
class AttentionShape:
    name: str
    q_heads: int  # per rank, at the tensor-parallel size it is served at
    kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool


QWEN3_ATTENTION = AttentionShape("Qwen3-235B-A22B at TP 4", 16, 1, 128, 128, False)
MIXTRAL_ATTENTION = AttentionShape("Mixtral-8x7B at TP 1", 32, 8, 128, 128, False)


def interpreted_kernels() -> list[tuple[object, Callable[[dict], dict]]]:
    """The kernels a CPU transport launches differently from a GPU (the communication kernels),
    each with how its launch's keywords differ on a GPU."""
    from moeserve.kernels import nvshmem_device, peer_copy

    def on_cuda(kwargs: dict) -> dict:
        """The CPU transport's launch as the dispatcher makes it on a GPU: its tiles and clock,
        and NVSHMEM's puts where the CPU emulates them, linked with the device library of each
        target (`extern_libs` given per architecture, see `compile_check.CompileCheck`)."""
        kwargs = dict(kwargs)
        if "BLOCK_W" in kwargs:
            kwargs["BLOCK_M"], kwargs["BLOCK_W"] = peer_copy.copy_tiles(kwargs["WORDS"], "cuda")
        if "HOST_CLOCK" in kwargs:
            kwargs["GLOBALTIMER"], kwargs["HOST_CLOCK"] = True, None
        for kind in ("KIND", "PUT"):
            if kwargs.get(kind) == peer_copy.PUT_EMULATED:
                kwargs[kind] = peer_copy.PUT_NVSHMEM.value
                kwargs["extern_libs"] = nvshmem_device.extern_libs
        return kwargs

    return [(k.compiled, on_cuda) for k in peer_copy.KERNELS]


# -- communication ---------------------------------------------------------------------------------


def _dispatch_rounds(
    shape: MoEShape, dispatch_fp8: bool, tokens: tuple[int, ...], nvlink_domain_size: int | None = None
) -> None:
    """Every rank of `shape.ep` emulated PEs dispatches and combines `len(tokens)` low-latency
    steps (sequence numbers 1, 2, ... through both ring slots and their credits) and one
    high-throughput step (the notify round, then two chunks), in lockstep. `nvlink_domain_size`
    below `shape.ep`: the other domains' peers are reached by the put variants, compiled as a
    GPU's (NVSHMEM's puts); 0: every peer, the rank itself too.

    No kernel runs, so the one value the host reads back, the counts the notify round delivers,
    is put in each rank's notify slot here, as the peers' notify kernels would have put it."""
    from moeserve.dispatch.counts import count_per_expert
    from moeserve.dispatch.nvshmem import NvshmemDispatcher
    from moeserve.dispatch.placement import ExpertPlacement
    from moeserve.dispatch.rows import DispatchRows
    from moeserve.dispatch.symmetric import EmulatedWorld, run_lockstep

    world = EmulatedWorld(shape.ep)
    dispatchers = [
        NvshmemDispatcher(
            ExpertPlacement.contiguous(shape.experts, shape.ep, rank),
            DispatchRows(shape.hidden, shape.top_k, BF16),
            heap=world.heaps[rank],
            chunk_tokens=16,
            dispatch_fp8=dispatch_fp8,
            nvlink_domain_size=nvlink_domain_size,
        )
        for rank in range(shape.ep)
    ]
    g = torch.Generator().manual_seed(0)
    rounds = [(t, 16) for t in tokens] + [(max(tokens) + 20, None)]
    inputs = [
        [
            (
                torch.randn(n, shape.hidden, generator=g).to(BF16),
                torch.stack([torch.randperm(shape.experts, generator=g)[: shape.top_k] for _ in range(n)]),
                torch.rand(n, shape.top_k, generator=g),
            )
            for _ in range(shape.ep)
        ]
        for n, _ in rounds
    ]

    def deliver_notify(sent: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for d in dispatchers:
            layout = d._layout
            slot = (d._seq["notify"] + 1) % layout.slots
            notify = d._buffer.view(
                layout.offsets["notify"], (layout.slots, layout.ep, layout.local_experts + 1), torch.int64
            )
            for source, (_, ids, _) in enumerate(sent):
                counts = count_per_expert(d._expert_slot[ids.reshape(-1)], layout.groups).view(layout.ep, -1)
                notify[slot, source, :-1] = counts[d.heap.rank]
                notify[slot, source, -1] = ids.shape[0]

    for (_, bound), sent in zip(rounds, inputs):
        if bound is None:
            deliver_notify(sent)
        run_lockstep([_one_round(dispatchers[r], *sent[r], bound) for r in range(shape.ep)])


def _one_round(dispatcher, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, bound: int | None):
    out = yield from dispatcher.dispatch_steps(hidden, ids, weights, bound)
    yield from dispatcher.combine_steps(out.hidden, out.handle)


# -- model kernels (compiled, never run) -----------------------------------------------------------


def _norms() -> None:
    from moeserve.kernels.norm import fused_add_rms_norm, rms_norm

    for hidden in (DEEPSEEK_V3.hidden, QWEN3_235B.hidden):
        for tokens in EDGE_TOKENS:
            x = torch.empty(tokens, hidden, dtype=BF16)
            rms_norm(x, torch.empty(hidden, dtype=BF16), 1e-6)
            fused_add_rms_norm(x, torch.empty_like(x), torch.empty(hidden, dtype=BF16), 1e-6)
    rms_norm(torch.empty(17, QWEN3_ATTENTION.q_heads, 128, dtype=BF16), torch.empty(128, dtype=BF16), 1e-6)  # q norm
    rms_norm(torch.empty(17, 512, dtype=BF16), torch.empty(512, dtype=BF16), 1e-6)  # DeepSeek's kv_a norm


def _rotary() -> None:
    from moeserve.kernels.rotary import apply_rotary, apply_rotary_qk_

    for shape in (QWEN3_ATTENTION, MIXTRAL_ATTENTION):
        for tokens in EDGE_TOKENS:
            q = torch.empty(tokens, shape.q_heads, shape.head_dim, dtype=BF16)
            k = torch.empty(tokens, shape.kv_heads, shape.head_dim, dtype=BF16)
            cos = torch.empty(tokens, shape.rotary_dim, dtype=BF16)
            apply_rotary_qk_(q, k, cos, torch.empty_like(cos), shape.interleaved)
    for tokens in EDGE_TOKENS:  # DeepSeek-V3: 128 heads' 64 rope dims, interleaved, and the shared k_rope
        cos = torch.empty(tokens, 64, dtype=BF16)
        apply_rotary(torch.empty(tokens, 128, 64, dtype=BF16), cos, torch.empty_like(cos), True)
        apply_rotary(torch.empty(tokens, 1, 64, dtype=BF16), cos, torch.empty_like(cos), True)


def _routing() -> None:
    from moeserve.kernels.routing import grouped_sigmoid_topk, softmax_topk

    for tokens in EDGE_TOKENS:
        softmax_topk(torch.empty(tokens, MIXTRAL.experts, dtype=BF16), MIXTRAL.top_k, renormalize=True)
        softmax_topk(torch.empty(tokens, QWEN3_235B.experts, dtype=BF16), QWEN3_235B.top_k, renormalize=True)
        grouped_sigmoid_topk(
            torch.empty(tokens, DEEPSEEK_V3.experts, dtype=BF16),
            DEEPSEEK_V3.top_k,
            num_groups=8,
            topk_groups=4,
            correction_bias=torch.zeros(DEEPSEEK_V3.experts),
            routed_scaling_factor=2.5,
        )


def _delta_rule_args(conv: torch.Tensor, query_lens: tuple[int, ...], hk: int, hv: int, dim: int) -> tuple:
    """A delta-rule launch's arguments as the Triton backend passes them: q, k and v split from
    the conv's output `[T, C]` (strided views), g float32, beta and the state slots, each sequence
    resuming from slot i."""
    tokens, seqs = conv.shape[0], len(query_lens)
    q, k, v = conv.split([hk * dim, hk * dim, hv * dim], dim=-1)
    return (
        q.reshape(tokens, hk, dim),
        k.reshape(tokens, hk, dim),
        v.reshape(tokens, hv, dim),
        torch.empty(tokens, hv),
        torch.empty(tokens, hv, dtype=BF16),
        torch.empty(seqs, hv, dim, dim),
        query_lens,
        tuple(range(seqs)),
        (True,) * seqs,
    )


def _v4_routing() -> None:
    from moeserve.kernels.routing import sqrtsoftplus_topk

    shape = DEEPSEEK_V4_FLASH
    for tokens in EDGE_TOKENS:
        sqrtsoftplus_topk(
            torch.empty(tokens, shape.experts, dtype=BF16),
            shape.top_k,
            correction_bias=torch.zeros(shape.experts),
            routed_scaling_factor=1.5,
        )


def _gated_delta() -> None:
    """Qwen3.5-35B-A3B's Gated DeltaNet at TP 1 (16 key heads, 32 value heads, 128 dims, a conv of 4
    taps): decode steps of 1, 16 and 17 sequences, and longer spans (one sequence, and a span
    beside two decodes: the kernel takes any length, though the Triton backend sends it spans of
    up to `RECURRENT_MAX_TOKENS` and drafts' verify spans only; lengths are device data, so they
    change no specialization). Then the variants that keep per-draft states (`DRAFTS`): verify
    spans of 1 + 3 tokens beside a decode without drafts, 3 drafts a step."""
    from moeserve.kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen

    hk, hv, dim = 16, 32, 128
    channels = (2 * hk + hv) * dim
    steps = [((1,) * n, (0,) * n) for n in EDGE_TOKENS] + [((17,), (0,)), ((16, 1, 1), (0, 0, 0))]
    steps += [((4, 4, 1), (3, 3, 0)), ((4,) * 16, (3,) * 16)]
    for query_lens, drafts in steps:
        tokens, seqs = sum(query_lens), len(query_lens)
        spans = (query_lens, tuple(range(seqs)), (True,) * seqs)
        kept = 1 + max(drafts)  # the draft states' positions, as the runtime allocates them (1 + k)
        conv = causal_conv1d_varlen(
            torch.empty(tokens, channels, dtype=BF16),
            torch.empty(channels, 4, dtype=BF16),
            torch.empty(seqs, channels, 3, dtype=BF16),
            *spans,
            drafts,
            torch.empty(seqs, kept, channels, 3, dtype=BF16),
        )
        draft_states = torch.empty(seqs, kept, hv, dim, dim)
        gated_delta_rule_varlen(
            *_delta_rule_args(conv, query_lens, hk, hv, dim), drafts=drafts, draft_states=draft_states
        )


def _chunk_delta() -> None:
    """The chunked delta rule at Qwen3-Next's and Qwen3.5-35B-A3B's DeltaNet shape (the same: 16
    key heads, 32 value heads of 128 dims) at TP 1 and TP 4 (4 and 8 heads), as the Triton backend
    launches it: prompt spans past `RECURRENT_MAX_TOKENS` (one of 9, one of 17, a long chunk, and
    a step whose decodes go to the recurrent kernel beside two prompt spans)."""
    from moeserve.kernels.chunk_delta import chunk_gated_delta_rule_varlen
    from moeserve.ops.triton_ops import RECURRENT_MAX_TOKENS

    dim = 128
    steps = [(RECURRENT_MAX_TOKENS + 1,), (17,), (2048,), (1, 200, 1, 64)]
    for hk, hv in ((16, 32), (4, 8)):
        for query_lens in steps:
            chosen = tuple(i for i, n in enumerate(query_lens) if n > RECURRENT_MAX_TOKENS)
            conv = torch.empty(sum(query_lens), (2 * hk + hv) * dim, dtype=BF16)
            chunk_gated_delta_rule_varlen(*_delta_rule_args(conv, query_lens, hk, hv, dim), chosen=chosen)


def _local_ids(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    return torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])


def _bf16_moe(shape: MoEShape, activation: GatedActivation | None = None, bias: bool = False) -> None:
    """bf16 experts of `shape` on one rank's share, at every config row of `KERNEL_CONFIGS`."""
    from moeserve.kernels.fused_moe import fused_moe
    from moeserve.kernels.launch_config import block_m_for
    from moeserve.kernels.moe_align import moe_align_block_size, moe_align_reference

    local = max(2, shape.experts // shape.ep // 8)  # a few local experts: the count is no constant
    top_k = min(shape.top_k, local)
    w13 = torch.empty(local, 2 * shape.intermediate, shape.hidden, dtype=BF16)
    w2 = torch.empty(local, shape.hidden, shape.intermediate, dtype=BF16)
    biases = None
    if bias:
        biases = (torch.empty(local, 2 * shape.intermediate, dtype=BF16), torch.empty(local, shape.hidden, dtype=BF16))
    for tokens in (1, 16, 17, 130, 600):  # tokens per expert 1 .. 300: each config row
        ids = _local_ids(tokens, top_k, local)
        block_m = block_m_for(tokens, top_k, local)
        moe_align_block_size(ids, local, block_m)
        aligned = moe_align_reference(ids, local, block_m)
        hidden = torch.empty(tokens, shape.hidden, dtype=BF16)
        fused_moe(hidden, w13, w2, aligned, top_k, activation=activation, biases=biases)


def _moe() -> None:
    for shape in (DEEPSEEK_V3, QWEN3_235B, MIXTRAL):
        _bf16_moe(shape)


def _v4_moe() -> None:
    """DeepSeek-V4-Flash's clamped-SiLU experts on one EP 8 rank's share: bf16 at every config
    row of `KERNEL_CONFIGS`, and block-scaled FP8 (w8a8) at decode and prefill counts. (Its FP4
    release runs the packed GEMMs, whose kernels the activation between them leaves unchanged.)"""
    from moeserve.kernels.fused_moe_fp8 import fused_moe_w8a8
    from moeserve.kernels.launch_config import block_m_for
    from moeserve.kernels.moe_align import moe_align_reference

    shape, clamped = DEEPSEEK_V4_FLASH, GatedActivation("clamped_silu", limit=10.0)
    _bf16_moe(shape, clamped)
    local = shape.experts // shape.ep // 8
    top_k = min(shape.top_k, local)
    w13_fp8 = _fp8_weight(local, 2, shape.intermediate, shape.hidden)
    w2_fp8 = _fp8_weight(local, 1, shape.hidden, shape.intermediate)
    for tokens in (1, 17, 300):
        aligned = moe_align_reference(_local_ids(tokens, top_k, local), local, block_m_for(tokens, top_k, local))
        hidden = torch.empty(tokens, shape.hidden, dtype=BF16)
        fused_moe_w8a8(hidden, w13_fp8, w2_fp8, aligned, top_k, activation=clamped)


def _gpt_oss_moe() -> None:
    """gpt-oss-120b's experts as bf16 weights: biases around the clamped SwiGLU (alpha 1.702,
    limit 7). (Its MXFP4 release has no Triton GEMM; its sinks and router keep it on torch.)"""
    _bf16_moe(GPT_OSS_120B, GatedActivation("clamped_swiglu", alpha=1.702, limit=7.0), bias=True)


def _fp8_weight(experts: int, parts: int, rows: int, cols: int) -> BlockFP8Weight:
    lead = (experts,) if experts else ()
    data = torch.zeros(*lead, parts * rows, cols, dtype=FP8_DTYPE)
    scales = torch.ones(*lead, parts, -(-rows // 128), -(-cols // 128))
    return BlockFP8Weight(data, scales, (128, 128))


def _fp8() -> None:
    """DeepSeek-V3's block-scaled FP8: the linear layers' w8a8 GEMM, the activations' quantizer,
    and the experts' w8a8 fused MoE."""
    from moeserve.kernels.fp8_gemm import w8a8_linear
    from moeserve.kernels.fp8_quant import per_token_group_quant
    from moeserve.kernels.fused_moe_fp8 import fused_moe_w8a8
    from moeserve.kernels.launch_config import block_m_for
    from moeserve.kernels.moe_align import moe_align_reference

    shape = DEEPSEEK_V3
    for tokens in (1, 16, 17, 300):
        x = torch.empty(tokens, shape.hidden, dtype=BF16)
        per_token_group_quant(x, 128)
        w8a8_linear(x, _fp8_weight(0, 1, 1536, shape.hidden))  # q_a_proj
        w8a8_linear(torch.empty(tokens, 1536, dtype=BF16), _fp8_weight(0, 1, 128 * 192 // 8, 1536))  # q_b_proj at TP 8
    local = 4
    w13 = _fp8_weight(local, 2, shape.intermediate, shape.hidden)
    w2 = _fp8_weight(local, 1, shape.hidden, shape.intermediate)
    for tokens in (1, 17, 300):
        ids = _local_ids(tokens, 2, local)
        aligned = moe_align_reference(ids, local, block_m_for(tokens, 2, local))
        fused_moe_w8a8(torch.empty(tokens, shape.hidden, dtype=BF16), w13, w2, aligned, 2)


def _packed_moe() -> None:
    """Packed 4-bit experts at DeepSeek-V3's shape: INT4 in groups of 32 (Kimi-K2.5's release),
    NVFP4 (DeepSeek-R1-FP4) and MXFP4 (DeepSeek-V4's FP4 experts), decode and prefill token counts."""
    from moeserve.kernels.launch_config import block_m_for
    from moeserve.kernels.moe_align import moe_align_reference
    from moeserve.kernels.packed_moe import PackedExperts, packed_moe

    shape, local = DEEPSEEK_V3, 4

    def int4(parts: int, rows: int, cols: int) -> PackedExperts:
        return PackedExperts(
            torch.zeros(local, parts * rows, cols // 8, dtype=torch.int32),
            torch.ones(local, parts * rows, cols // 32, dtype=BF16),
        )

    def nvfp4(parts: int, rows: int, cols: int) -> PackedExperts:
        scales = torch.ones(local, parts * rows, cols // 16).to(FP8_DTYPE)
        return PackedExperts(
            torch.zeros(local, parts * rows, cols // 2, dtype=torch.uint8), scales, torch.ones(local, parts)
        )

    def mxfp4(parts: int, rows: int, cols: int) -> PackedExperts:
        return PackedExperts(
            torch.zeros(local, parts * rows, cols // 2, dtype=torch.uint8),
            torch.full((local, parts * rows, cols // 32), 127, dtype=torch.uint8),
        )

    for make in (int4, nvfp4, mxfp4):
        w13, w2 = make(2, shape.intermediate, shape.hidden), make(1, shape.hidden, shape.intermediate)
        for tokens in (1, 17, 300):
            aligned = moe_align_reference(_local_ids(tokens, 2, local), local, block_m_for(tokens, 2, local))
            packed_moe(torch.empty(tokens, shape.hidden, dtype=BF16), w13, w2, aligned, 2)


def _paged_attention() -> None:
    """Decode-only steps (split-KV) and mixed steps (prefill tiles), GQA shapes, block size 16."""
    from moeserve.kernels.paged_attention import paged_attention, paged_inputs

    block_size, blocks = 16, 64
    for shape in (QWEN3_ATTENTION, MIXTRAL_ATTENTION):
        k_cache = torch.empty(blocks, block_size, shape.kv_heads, shape.head_dim, dtype=BF16)
        v_cache = torch.empty_like(k_cache)
        for starts, lens in (([40], [1]), ([40, 600, 7], [1, 1, 1]), ([0], [17]), ([0, 33], [16, 1])):
            tables = [
                list(range(i * 40, i * 40 + 40))[: -(-(s + n) // block_size)]
                for i, (s, n) in enumerate(zip(starts, lens))
            ]
            tables = [[b % blocks for b in t] for t in tables]
            inputs = paged_inputs(tables, starts, lens, block_size, "cpu")
            q = torch.empty(inputs.num_tokens, shape.q_heads, shape.head_dim, dtype=BF16)
            paged_attention(q, k_cache, v_cache, inputs, shape.head_dim**-0.5)


def _mla() -> None:
    """DeepSeek-V3's latent attention at TP 8 (16 heads of 512 + 64), decode and prefill."""
    from moeserve.kernels.mla_attention import mla_latent_attention
    from moeserve.kernels.paged_attention import paged_inputs

    heads, lora, rope, block_size = 16, 512, 64, 64
    kv_cache = torch.empty(32, block_size, lora + rope, dtype=BF16)
    for starts, lens in (([100], [1]), ([100, 900], [1, 1]), ([0], [17])):
        tables = [
            [(i * 16 + j) % 32 for j in range(-(-(s + n) // block_size))] for i, (s, n) in enumerate(zip(starts, lens))
        ]
        inputs = paged_inputs(tables, starts, lens, block_size, "cpu")
        tokens = inputs.num_tokens
        mla_latent_attention(
            torch.empty(tokens, heads, lora, dtype=BF16),
            torch.empty(tokens, heads, rope, dtype=BF16),
            kv_cache,
            inputs,
            (128 + 64) ** -0.5,
            lora,
        )


def _sparse_mla() -> None:
    """DeepSeek Sparse Attention at the releases' shapes: the indexer (DeepSeek-V3.2: 64 heads of
    128; GLM-5: 32) over a context past its top 2048, and sparse MLA of 16 heads (V3.2 at TP 8)
    and 8 (GLM-5 at TP 8) of 512 + 64 over the chosen positions; decodes and a prefill chunk."""
    from moeserve.kernels.paged_attention import paged_inputs
    from moeserve.kernels.sparse_mla import indexer_topk, sparse_mla_latent_attention

    lora, rope, block_size, topk, blocks = 512, 64, 64, 2048, 80
    kv_cache = torch.empty(blocks, block_size, lora + rope, dtype=BF16)
    key_cache = torch.empty(blocks, block_size, 128, dtype=BF16)
    for starts, lens in (([3000], [1]), ([3000, 4100], [1, 1]), ([2100], [17])):
        tables = [
            [(i * 40 + j) % blocks for j in range(-(-(s + n) // block_size))]
            for i, (s, n) in enumerate(zip(starts, lens))
        ]
        inputs = paged_inputs(tables, starts, lens, block_size, "cpu")
        tokens = inputs.num_tokens
        for index_heads, heads in ((64, 16), (32, 8)):
            q = torch.empty(tokens, index_heads, 128, dtype=BF16)
            chosen = indexer_topk(q, torch.empty(tokens, index_heads), key_cache, inputs, topk)
            sparse_mla_latent_attention(
                torch.empty(tokens, heads, lora, dtype=BF16),
                torch.empty(tokens, heads, rope, dtype=BF16),
                kv_cache,
                chosen,
                inputs,
                (128 + 64) ** -0.5,
                lora,
            )


def _compressed_attention() -> None:
    """DeepSeek-V4-Flash's attention as its layers launch it (`TritonOps`, one sequence a call;
    attention is replicated under TP, so all 64 heads of 512 on every rank), the runtime's block
    size of 16: a window of 128 alone, with every closed entry of 128 tokens (HCA), and with the
    indexer's top 512 of the entries of 4 (64 index heads of 128, CSA); a decode and a prefill
    chunk, each deep enough that the indexer has more entries than its top-k."""
    from moeserve.ops.compressed_attention import PagedRows, SequenceKeys
    from moeserve.ops.triton_ops import TritonOps

    ops, heads, head_dim, window, block_size, blocks = TritonOps(), 64, 512, 128, 16, 400
    sinks = torch.empty(heads)
    rows = PagedRows(torch.empty(blocks, block_size, head_dim, dtype=BF16), torch.arange(blocks), block_size)
    index_keys = PagedRows(torch.empty(blocks, block_size, 128, dtype=BF16), torch.arange(blocks), block_size)
    for start, n in ((5000, 1), (4100, 17)):
        q = torch.empty(n, heads, head_dim, dtype=BF16)
        ops.compressed_attention(q, sinks, head_dim**-0.5, SequenceKeys(start, rows, window), None)
        ops.compressed_attention(q, sinks, head_dim**-0.5, SequenceKeys(start, rows, window, rows, 128), None)
        index_q, weights = torch.empty(n, 64, 128, dtype=BF16), torch.empty(n, 64)
        chosen = ops.compressed_select(index_q, weights, index_keys, start, 4, 512)
        ops.compressed_attention(q, sinks, head_dim**-0.5, SequenceKeys(start, rows, window, rows, 4), chosen)


CASES: list[Case] = [
    Case("norm", "RMSNorm and fused add+RMSNorm, DeepSeek-V3/Qwen3 widths", lambda: _compile_only(_norms)()),
    Case("rotary", "rotary q/k (neox) and DeepSeek's interleaved rope", lambda: _compile_only(_rotary)()),
    Case("routing", "softmax top-k and DeepSeek's grouped sigmoid top-k", lambda: _compile_only(_routing)()),
    Case("routing", "DeepSeek-V4-Flash sqrtsoftplus top-6 of 256", lambda: _compile_only(_v4_routing)()),
    Case("fused_moe", "moe_align + bf16 fused MoE, three models x five token counts", lambda: _compile_only(_moe)()),
    Case(
        "fused_moe",
        "DeepSeek-V4-Flash clamped-SiLU fused MoE at EP 8: bf16 x five token counts, w8a8 x three",
        lambda: _compile_only(_v4_moe)(),
    ),
    Case(
        "fused_moe",
        "gpt-oss-120b biased clamped-SwiGLU fused MoE at EP 4, bf16 x five token counts",
        lambda: _compile_only(_gpt_oss_moe)(),
    ),
    Case("fp8", "FP8 group quant, w8a8 linear and w8a8 fused MoE, DeepSeek-V3", lambda: _compile_only(_fp8)()),
    Case(
        "packed_moe",
        "INT4 (W4A16), NVFP4 and MXFP4 packed-expert GEMMs, DeepSeek-V3",
        lambda: _compile_only(_packed_moe)(),
    ),
    Case(
        "paged_attention",
        "paged attention: decode split-KV and prefill, GQA",
        lambda: _compile_only(_paged_attention)(),
    ),
    Case("mla_attention", "MLA latent attention, DeepSeek-V3 at TP 8", lambda: _compile_only(_mla)()),
    Case(
        "sparse_mla",
        "DSA indexer scores and sparse MLA, DeepSeek-V3.2 and GLM-5 at TP 8",
        lambda: _compile_only(_sparse_mla)(),
    ),
    Case(
        "compressed_attention",
        "DeepSeek-V4-Flash attention (window, HCA, CSA with its indexer's top 512), 64 heads of 512",
        lambda: _compile_only(_compressed_attention)(),
    ),
    Case(
        "gated_delta",
        "Gated DeltaNet conv and delta rule, Qwen3.5-35B-A3B: decodes, prompt chunks, drafts' verify spans",
        lambda: _compile_only(_gated_delta)(),
    ),
    Case(
        "chunk_delta",
        "chunked gated delta rule, Qwen3-Next / Qwen3.5-35B-A3B at TP 1 and 4: prompt spans",
        lambda: _compile_only(_chunk_delta)(),
    ),
    Case(
        "peer_copy",
        "nvshmem dispatch/combine, Mixtral at EP 2",
        lambda: _compile_only(lambda: _dispatch_rounds(MIXTRAL, False, (1, 3, 2)))(),
    ),
    Case(
        "peer_copy",
        "nvshmem dispatch/combine, DeepSeek-V3 at EP 8, FP8 rows",
        lambda: _compile_only(lambda: _dispatch_rounds(DEEPSEEK_V3, True, (1, 2, 1)))(),
    ),
    Case(
        "peer_copy",
        "nvshmem puts between nodes: DeepSeek-V3 at EP 8 over two nodes, FP8 rows",
        lambda: _compile_only(lambda: _dispatch_rounds(DEEPSEEK_V3, True, (1, 2, 1), nvlink_domain_size=4))(),
    ),
    Case(
        "peer_copy",
        "nvshmem puts only (nvlink_domain_size 0): DeepSeek-V3 at EP 1, one GPU putting to itself, bf16 rows",
        lambda: _compile_only(lambda: _dispatch_rounds(replace(DEEPSEEK_V3, ep=1), False, (1, 2, 1), 0))(),
    ),
]


def _compile_only(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with compile_only(), torch.no_grad():
            fn()

    return run
