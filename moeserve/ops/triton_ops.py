"""`TritonOps`: the `LayerOps` backend that runs the layers on moeserve's Triton kernels.

The GPU path. On CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which the
tests use to check that a whole model gives the torch path's greedy tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.config import BlockFP8Config, MLAConfig, ModelConfig, MXFP4Config, RouterConfig
from moeserve.dispatch.base import DispatchLayout
from moeserve.dispatch.fp8 import GROUP as FP8_ROW_GROUP
from moeserve.fp8_format import BlockFP8Weight
from moeserve.kernels import compressed_attention as v4_kernels
from moeserve.kernels.chunk_delta import chunk_gated_delta_rule_varlen
from moeserve.kernels.fp8_gemm import w8a8_linear
from moeserve.kernels.fp8_quant import group_problem
from moeserve.kernels.fused_moe import fused_moe
from moeserve.kernels.fused_moe_fp8 import fused_moe_w8a8
from moeserve.kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen
from moeserve.kernels.launch_config import block_m_for
from moeserve.kernels.mla_attention import mla_decode
from moeserve.kernels.moe_align import moe_align_block_size
from moeserve.kernels.norm import fused_add_rms_norm, rms_norm
from moeserve.kernels.packed_moe import packed_moe
from moeserve.kernels.paged_attention import PagedInputs, paged_attention, paged_inputs
from moeserve.kernels.rotary import apply_rotary_qk_
from moeserve.kernels.routing import route
from moeserve.kernels.sparse_mla import indexer_topk, sparse_mla
from moeserve.ops.attention import AttentionBatch, AttentionPlan, DecodeGraphInputs
from moeserve.ops.base import LayerOps, Weight
from moeserve.ops.compressed_attention import PagedRows, SequenceKeys
from moeserve.ops.gated_delta import split_heads
from moeserve.ops.grouped_mlp import row_experts
from moeserve.ops.state_batch import StateStep
from moeserve.packed_weight import PackedExperts

# A span of up to this many tokens takes the recurrent delta-rule kernel: there a token costs one
# dependent `[Dk, BV]` update, where the chunked form pays a second launch, a `[C, C]` inverse
# written and read back and a chunk's worth of matmuls whatever the span's length, and its
# forward substitution is as serial as the walk for the span's rows. Past a few tokens the
# chunked form's matmuls win; 8 is that estimate (decodes are 1, drafts' verifies 1 + k), not yet
# a GPU measurement.
RECURRENT_MAX_TOKENS = 8


@dataclass(frozen=True)
class TritonAttentionPlan(AttentionPlan):
    """paged: block tables and lengths as device tensors; the kernels walk the block tables
    themselves, so no per-sequence slot list is ever built."""

    paged: PagedInputs


class TritonOps(LayerOps[TritonAttentionPlan]):
    name = "triton"

    @classmethod
    def supports(cls, device: torch.device) -> str | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (
                "the Triton kernels run on CUDA devices (or, for tests, on CPU with TRITON_INTERPRET=1); "
                f"device is {device}"
            )
        return None

    @classmethod
    def supports_model(cls, cfg: ModelConfig) -> str | None:
        """Block-quantized FP8 weights run as w8a8 when their K tile suits the kernels, INT4,
        NVFP4 and DeepSeek-V4's MXFP4 experts as packed grouped GEMMs; DeepSeek-V4 runs whole (its
        attention and indexer, its sqrtsoftplus router, its clamped SiLU experts; its hash-routed
        layers and mHC are torch arithmetic, no choice to make). gpt-oss's MXFP4 experts (stacked,
        biased, handed over dequantized), its attention sinks (paged attention kernels) and its
        top-k-then-softmax router with a bias (`route`) have no kernel yet; its experts in the
        compute dtype do (`fused_moe`: biases, clamped SwiGLU)."""
        if isinstance(cfg.weight_quant, MXFP4Config):
            return "the Triton kernels have no gpt-oss MXFP4 expert GEMM (biased experts) yet; use kernels=torch for it"
        if isinstance(cfg.weight_quant, BlockFP8Config) and group_problem(cfg.weight_quant.block[1]) is not None:
            return f"{group_problem(cfg.weight_quant.block[1])}; use kernels=torch"
        if cfg.attention_sinks:
            return "the Triton attention kernels have no attention sinks (gpt-oss); use kernels=torch"
        if cfg.expert_bias and cfg.weight_quant is not None:
            return "the Triton fused MoE takes expert biases (gpt-oss) with unquantized experts only; use kernels=torch"
        if cfg.router.kind == "topk_softmax" or cfg.router.has_bias:
            return "the Triton routing kernel has no top-k-then-softmax router with a bias (gpt-oss); use kernels=torch"
        if cfg.dsa is not None and cfg.dsa.fp8_keys:
            return "the Triton indexer kernel reads keys in the compute dtype, not FP8 ones; use kernels=torch"
        return None

    def plan_attention(self, batch: AttentionBatch) -> TritonAttentionPlan:
        paged = paged_inputs(
            batch.block_tables, batch.start_positions, batch.query_lens, batch.block_size, batch.device
        )
        return TritonAttentionPlan(batch.slot_mapping, paged)

    def decode_graph_planner(self, inputs: DecodeGraphInputs) -> Callable[[], TritonAttentionPlan]:
        """One plan for every replay: the kernels read the buffers, and the split-KV grid is sized
        for `max_context_len`. A sequence's partitions are fixed at 512 keys whatever the grid (a
        program past its sequence's last partition does nothing), so its bits are the eager
        step's, where the grid followed that step's longest context."""
        paged = PagedInputs(
            block_table=inputs.block_table,
            context_lens=inputs.context_lens,
            query_start=inputs.query_start,
            max_query_len=1,
            max_context_len=inputs.max_context_len,
            num_tokens=inputs.num_seqs,
            block_size=inputs.block_size,
        )
        plan = TritonAttentionPlan(inputs.slot_mapping, paged)
        return lambda: plan

    def gated_delta_net(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weight: torch.Tensor,
        step: StateStep,
        head_dims: tuple[int, int],
    ) -> torch.Tensor:
        """The conv for every sequence in one varlen launch; the delta rule in its recurrent form
        for decodes, spans of up to `RECURRENT_MAX_TOKENS` and drafts' verify spans (whatever
        their length: the states after each token are kept there), in its chunked form for
        longer prompt spans, each kernel over its share of the step's sequences. Sequences
        whose drafts were not all accepted first step back, as on the torch path."""
        state, batch = step.state, step.batch
        state.restore(batch.slots, batch.restores)
        drafts = batch.drafts or (0,) * len(batch.slots)
        spans = (batch.query_lens, batch.slots, batch.resumes)
        conv = causal_conv1d_varlen(mixed, conv_weight, state.conv, *spans, drafts, state.draft_conv)
        q, k, v = split_heads(conv, head_dims, g.shape[1])
        out = q.new_empty(q.shape[0], g.shape[1], head_dims[1])
        walks = [bool(d) or n <= RECURRENT_MAX_TOKENS for n, d in zip(batch.query_lens, drafts)]
        recurrent = tuple(i for i, n in enumerate(batch.query_lens) if n and walks[i])
        long = tuple(i for i, n in enumerate(batch.query_lens) if n and not walks[i])
        if recurrent:
            gated_delta_rule_varlen(
                q, k, v, g, beta, state.recurrent, *spans, recurrent, out, drafts, state.draft_recurrent
            )
        if long:
            chunk_gated_delta_rule_varlen(q, k, v, g, beta, state.recurrent, *spans, chosen=long, out=out)
        return out

    # The kernels take strided views and empty steps as they are: no copies on the way in.
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, weight, eps)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """FP8: the w8a8 GEMM (x quantized per token group), bias added after; dense: cuBLAS."""
        if not isinstance(weight, BlockFP8Weight):
            return F.linear(x, weight, bias)
        out = w8a8_linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, one launch for both."""
        apply_rotary_qk_(q, k, cos, sin, interleaved)
        return q, k

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:
            raise ValueError("kernels=triton: the attention kernels have no attention sinks (see supports_model)")
        return paged_attention(q, k_cache, v_cache, plan.paged, scale, sliding_window)

    def mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        kv_b_weight: torch.Tensor,
        mla: MLAConfig,
        scale: float,
    ) -> torch.Tensor:
        if q_nope.shape[0] == 0:
            return q_nope.new_empty(0, q_nope.shape[1], mla.v_head_dim)
        return mla_decode(q_nope, q_rope, kv_cache, kv_b_weight, plan.paged, scale, mla)

    def dsa_select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        key_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        index_topk: int,
    ) -> torch.Tensor | None:
        """Each token's top-k positions `[T, index_topk]` int32 (-1: none), or None when no
        context of the step is longer than `index_topk` (dense, the same result)."""
        if plan.paged.max_context_len <= index_topk or q.shape[0] == 0:
            return None
        return indexer_topk(q.contiguous(), weights, key_cache, plan.paged, index_topk)

    def sparse_mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        kv_b_weight: torch.Tensor,
        mla: MLAConfig,
        scale: float,
        selection: torch.Tensor | None,
    ) -> torch.Tensor:
        if selection is None:
            return self.mla_attention(q_nope, q_rope, kv_cache, plan, kv_b_weight, mla, scale)
        return sparse_mla(q_nope, q_rope, kv_cache, kv_b_weight, selection, plan.paged, scale, mla)

    def compressed_select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: PagedRows, start: int, ratio: int, top_k: int
    ) -> torch.Tensor:
        """Each query's best entries `[S, min(top_k, E)]` int32 (-1: fewer visible), E the
        entries closed by the sequence's last query."""
        seq, pos = _sequence_tokens(start, q.shape[0], q.device)
        num_entries = (start + q.shape[0]) // ratio
        return v4_kernels.indexer_topk(
            q.contiguous(), weights, keys.cache, keys.table[None], seq, pos, num_entries, ratio, top_k, keys.block_size
        )

    def compressed_attention(
        self, q: torch.Tensor, sinks: torch.Tensor, scale: float, keys: SequenceKeys, selection: torch.Tensor | None
    ) -> torch.Tensor:
        seq, pos = _sequence_tokens(keys.start, q.shape[0], q.device)
        window = (keys.window.cache, keys.window.table[None], keys.window_len)
        entries = None if keys.entries is None else (keys.entries.cache, keys.entries.table[None], keys.ratio)
        return v4_kernels.sink_attention(q, sinks, scale, seq, pos, *window, entries, selection, keys.window.block_size)

    def route(
        self, cfg: RouterConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return route(cfg, logits, correction_bias)

    def experts(self, x, layout, counts, topk_ids, w13, w2, b13=None, b2=None, activation=None, x_fp8=None):
        """TOKEN_MAJOR: `fused_moe` gathers each pair's token from `topk_ids` itself (top_k = K).
        EXPERT_MAJOR: each row is one pair of its own (top_k = 1) whose expert follows from the
        device counts; padding rows get no expert and come out as zeros. The weights stay with combine().
        FP8 experts run the w8a8 fused MoE on their stored bytes and scales, and on the FP8 rows
        the dispatch delivered when their groups are the weights' K blocks (128 channels, as
        DeepSeek-V3's): no quantization of the rows' dequantised values again. INT4 and NVFP4
        experts run the packed grouped GEMMs on their stored codes and scales (W4A16). Each takes
        the experts' activation (SiLU, or a clamped kind) as a compile-time choice; biases (b13
        and b2 together, gpt-oss) go with unquantized experts only."""
        biases = None if b13 is None and b2 is None else (b13, b2)
        if biases is not None and (b13 is None or b2 is None or not isinstance(w13, torch.Tensor)):
            raise ValueError("kernels=triton: expert biases need both b13 and b2 and unquantized experts")
        if type(w13) is not type(w2):
            raise ValueError("kernels=triton: w13 and w2 must be stored alike (FP8, packed or unquantized)")
        num_experts = w13.shape[0]
        if layout is DispatchLayout.EXPERT_MAJOR:
            topk_ids = row_experts(counts, x.shape[0])[:, None]
        num_rows, top_k = topk_ids.shape
        aligned = moe_align_block_size(topk_ids, num_experts, block_m_for(num_rows, top_k, num_experts))
        if isinstance(w13, PackedExperts):
            return packed_moe(x.contiguous(), w13, w2, aligned, top_k=top_k, activation=activation)
        if not isinstance(w13, BlockFP8Weight):
            return fused_moe(x.contiguous(), w13, w2, aligned, top_k=top_k, activation=activation, biases=biases)
        quantized = None
        if x_fp8 is not None and w13.block[1] == FP8_ROW_GROUP:
            quantized = (x_fp8.q, x_fp8.scales)
        return fused_moe_w8a8(
            x.contiguous(), w13, w2, aligned, top_k=top_k, hidden_fp8=quantized, activation=activation
        )


def _sequence_tokens(start: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's `count` tokens from position `start` as the kernels take a step's tokens:
    each one's row of the block tables (0: the sequence's table is the only row) and position."""
    pos = torch.arange(start, start + count, dtype=torch.int32, device=device)
    return torch.zeros_like(pos), pos
