"""`TorchOps`: the reference `LayerOps` backend, plain torch, and the CPU path."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeserve.config import MLAConfig, RouterConfig
from moeserve.dispatch.base import DispatchLayout
from moeserve.ops.attention import AttentionBatch, DecodeGraphInputs
from moeserve.ops.base import LayerOps, Weight, dense_weight
from moeserve.ops.compressed_attention import compressed_attention, compressed_select
from moeserve.ops.gated_delta import gated_delta_net
from moeserve.ops.grouped_mlp import grouped_mlp
from moeserve.ops.rotary import apply_rotary
from moeserve.ops.sparse_mla import Selection, indexer_topk, sparse_mla_attention
from moeserve.ops.torch_attention import (
    TorchAttentionPlan,
    decode_graph_planner,
    mla_attention,
    paged_attention,
    torch_attention_plan,
)


class TorchOps(LayerOps[TorchAttentionPlan]):
    """The reference: plain torch, exact per sequence (batch-invariant attention)."""

    name = "torch"

    def plan_attention(self, batch: AttentionBatch) -> TorchAttentionPlan:
        return torch_attention_plan(batch)

    def decode_graph_planner(self, inputs: DecodeGraphInputs) -> Callable[[], TorchAttentionPlan]:
        return decode_graph_planner(inputs)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's RMSNorm: float32 `x * rsqrt(mean(x^2) + eps)`, cast back, then the weight (cast
        before scaling keeps bf16 results bit-identical to the reference). On CPU torch's
        `rms_norm` without a weight runs those same ops in one call, bit for bit (checked by
        tests/unit/test_torch_rms_norm.py), about 4 us a call faster; elsewhere, the ops themselves."""
        dtype = x.dtype
        if x.device.type == "cpu":
            return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        return self.rms_norm(h, weight, eps), h

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """An FP8 weight is dequantized at use (weight-only: x is not quantized)."""
        return F.linear(x, dense_weight(weight, x.dtype), bias)

    gated_delta_net = staticmethod(gated_delta_net)
    compressed_select = staticmethod(compressed_select)
    compressed_attention = staticmethod(compressed_attention)

    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated as one tensor of their heads side by side: the same elementwise ops on
        the same values, so the same bits, in one pass instead of two (a decode step on CPU pays
        per op); q and k come back as views of it."""
        if q.dtype != k.dtype:
            return apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)
        both = apply_rotary(torch.cat((q, k), dim=1), cos, sin, interleaved)
        return both[:, : q.shape[1]], both[:, q.shape[1] :]

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TorchAttentionPlan,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, plan, scale, sliding_window, sinks)

    def mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TorchAttentionPlan,
        kv_b_weight: torch.Tensor,
        mla: MLAConfig,
        scale: float,
    ) -> torch.Tensor:
        return mla_attention(q_nope, q_rope, kv_cache, plan, kv_b_weight, mla, scale)

    def dsa_select(
        self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, plan: TorchAttentionPlan, index_topk: int
    ) -> Selection:
        """Per bucket, each query's chosen keys, or None where the bucket attends densely."""
        return indexer_topk(q, weights, key_cache, plan, index_topk)

    def sparse_mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TorchAttentionPlan,
        kv_b_weight: torch.Tensor,
        mla: MLAConfig,
        scale: float,
        selection: Selection,
    ) -> torch.Tensor:
        return sparse_mla_attention(q_nope, q_rope, kv_cache, plan, kv_b_weight, mla, scale, selection)

    def route(
        self, cfg: RouterConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_experts = logits.shape
        if cfg.kind == "grouped_sigmoid":
            return _grouped_sigmoid(cfg, logits, correction_bias)
        if cfg.kind == "sqrtsoftplus":
            return _sqrtsoftplus(cfg, logits, correction_bias)
        if cfg.kind == "topk_softmax":  # gpt-oss: softmax over the k best logits only
            top, ids = torch.topk(logits, cfg.top_k, dim=-1)
            return ids, torch.softmax(top, dim=1, dtype=top.dtype).float()
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if cfg.num_groups > 1:  # DeepSeek-V2: experts only from the groups with the best expert
            grouped = probs.view(num_tokens, cfg.num_groups, num_experts // cfg.num_groups)  # [T, G, E/G]
            top_groups = grouped.amax(dim=-1).topk(cfg.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=logits.device).scatter_(1, top_groups, True)
            probs = probs.masked_fill(~keep[:, :, None].expand_as(grouped).reshape_as(probs), 0.0)
        weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * cfg.routed_scaling_factor

    def experts(self, x, layout, counts, topk_ids, w13, w2, b13=None, b2=None, activation=None, x_fp8=None):
        """One grouped GEMM pair over all experts; token-major pairs are sorted by expert first
        (a stable device sort of static size) and their outputs put back in pair order. FP8 weights
        are dequantized at use, all local experts at once (weight-only: x as it is, `x_fp8` unused)."""
        w13, w2 = dense_weight(w13, x.dtype), dense_weight(w2, x.dtype)
        if layout is DispatchLayout.EXPERT_MAJOR:
            return grouped_mlp(x, counts, w13, w2, b13, b2, activation)
        order = torch.argsort(topk_ids.reshape(-1), stable=True)  # [T*K] pairs grouped by expert
        rows = x.index_select(0, order // topk_ids.shape[1])
        out = grouped_mlp(rows, counts, w13, w2, b13, b2, activation)
        return torch.empty_like(rows).index_copy_(0, order, out)


def sqrtsoftplus_weights(cfg: RouterConfig, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's weights of the chosen experts `ids [T, K]` from all scores `[T, E]`:
    renormalised whatever `norm_topk_prob` says (as transformers does), then scaled."""
    weights = scores.gather(1, ids)
    return (weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)) * cfg.routed_scaling_factor


def _sqrtsoftplus(
    cfg: RouterConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's learned routing: the correction bias only chooses."""
    scores = F.softplus(logits.float()).sqrt()
    biased = scores if correction_bias is None else scores + correction_bias
    ids = torch.topk(biased, cfg.top_k, dim=-1, sorted=False).indices
    return ids, sqrtsoftplus_weights(cfg, scores, ids).float()


def _grouped_sigmoid(
    cfg: RouterConfig, scores_logits: torch.Tensor, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: pick top groups by the sum of their two best biased scores, then top-k
    experts inside them; weights are the unbiased scores of the chosen experts."""
    num_tokens, num_experts = scores_logits.shape
    scores = scores_logits.sigmoid()  # [T, E]
    biased = scores + correction_bias if correction_bias is not None else scores
    grouped = biased.view(
        num_tokens, cfg.num_groups, num_experts // cfg.num_groups
    )  # [T, G, E/G] (explicit: T may be 0)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
    top_groups = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(cfg.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


TORCH_OPS = TorchOps()
