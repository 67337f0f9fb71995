"""Attention over the paged cache in plain torch: the reference every backend is held to, and the
CPU path.

One sequence at a time, over that sequence's context gathered from the cache: exact, and a
sequence's result does not depend on what else is in the batch (batch invariance). The plan
holds, per sequence, the slots of its whole context, which is what that gather needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.config import MLAConfig
from moeserve.ops.attention import AttentionBatch, AttentionPlan, gather_from_cache


@dataclass(frozen=True)
class TorchAttentionPlan(AttentionPlan):
    """query_lens:    per sequence, how many of its tokens are in this step (sum = T).
    context_slots: per sequence, `[context_len]` int64 slots of its whole context, in order.
    """

    query_lens: tuple[int, ...]
    context_slots: tuple[torch.Tensor, ...]


def _context_slots(block_ids: Sequence[int], end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [0, end) for a sequence with block table `block_ids`."""
    positions = torch.arange(end, dtype=torch.int64)
    table = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def torch_attention_plan(batch: AttentionBatch) -> TorchAttentionPlan:
    """Every sequence's context slots, on the batch's device."""
    context_slots = tuple(
        _context_slots(blocks, end, batch.block_size).to(batch.device)
        for blocks, end in zip(batch.block_tables, batch.context_lens)
    )
    return TorchAttentionPlan(slot_mapping=batch.slot_mapping, query_lens=batch.query_lens, context_slots=context_slots)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of the last Lq context positions over all Lk of them.

    q `[Lq, Hq, Dk]`, k `[Lk, Hkv, Dk]`, v `[Lk, Hkv, Dv]` with Lq <= Lk; query i sits at
    position Lk - Lq + i and sees keys at positions <= its own (and inside the window).
    Returns `[Lq, Hq, Dv]`. Softmax in float32 as the reference implementations do.
    """
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    if group > 1:  # GQA: each KV head serves `group` query heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Lq, Lk]
    q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
    k_pos = torch.arange(lk, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for every sequence of the step over its paged context.

    q `[T, Hq, D]`; caches `[num_blocks, block_size, Hkv, D]` already holding this step's K/V.
    Returns `[T, Hq, Dv]`.
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    start = 0
    for qlen, slots in zip(plan.query_lens, plan.context_slots):
        k = gather_from_cache(k_cache, slots)
        v = gather_from_cache(v_cache, slots)
        out[start : start + qlen] = causal_attention(q[start : start + qlen], k, v, scale, sliding_window)
        start += qlen
    return out


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    kv_b_weight: torch.Tensor,
    mla: MLAConfig,
    scale: float,
) -> torch.Tensor:
    """MLA, expanded: each sequence's context latents through kv_b_proj, then plain attention."""
    num_heads = q_nope.shape[1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    out = q.new_empty(q.shape[0], num_heads, mla.v_head_dim)
    start = 0
    for qlen, slots in zip(plan.query_lens, plan.context_slots):
        latent, k_rope = gather_from_cache(kv_cache, slots).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = F.linear(latent, kv_b_weight).view(latent.shape[0], num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, num_heads, -1)), dim=-1)
        out[start : start + qlen] = causal_attention(q[start : start + qlen], k, v, scale)
        start += qlen
    return out
