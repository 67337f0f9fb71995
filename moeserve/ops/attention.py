"""Paged attention, torch reference path (CPU and correctness baseline for the GPU kernels).

The KV cache is a pool of fixed-size blocks; each sequence owns a block table mapping its
logical block i to a physical block id. A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened pool.

`AttentionMetadata` is planned once per step (`plan_attention`) and reused by every layer:
the slot of every new token and, per sequence, the slots of its whole context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step attention plan. B = sequences in the step, T = tokens in the step.

    slot_mapping:    `[T]` int64, cache slot each new token's K/V is written to.
    query_lens:      per sequence, how many of its tokens are in this step (sum = T).
    context_lens:    per sequence, context length after this step (cached + new tokens).
    context_slots:   per sequence, `[context_len]` int64 slots of its whole context, in order.
    block_tables, start_positions, block_size: the plan's inputs, for kernels that walk block
                     tables themselves; `kernel` holds what a `LayerOps` backend derived from them.
    """

    slot_mapping: torch.Tensor
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    context_slots: tuple[torch.Tensor, ...]
    block_tables: tuple[tuple[int, ...], ...] = ()
    start_positions: tuple[int, ...] = ()
    block_size: int = 0
    kernel: object | None = None


def slots_for(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [start, end) for a sequence with block table `block_ids`."""
    positions = torch.arange(start, end, dtype=torch.int64)
    table = torch.as_tensor(list(block_ids), dtype=torch.int64)
    needed = (end + block_size - 1) // block_size
    if table.numel() < needed:
        raise ValueError(f"block table holds {table.numel()} blocks, positions up to {end} need {needed}")
    return table[positions // block_size] * block_size + positions % block_size


def plan_attention(
    block_tables: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the step's attention plan from each sequence's block table and token range."""
    context_slots, new_slots, context_lens = [], [], []
    for blocks, start, qlen in zip(block_tables, start_positions, query_lens):
        ctx = slots_for(blocks, 0, start + qlen, block_size)
        context_slots.append(ctx.to(device))
        new_slots.append(ctx[start:])
        context_lens.append(start + qlen)
    slot_mapping = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.int64)
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_lens=tuple(int(q) for q in query_lens),
        context_lens=tuple(context_lens),
        context_slots=tuple(context_slots),
        block_tables=tuple(tuple(b) for b in block_tables),
        start_positions=tuple(int(s) for s in start_positions),
        block_size=block_size,
    )


def write_to_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `values [T, ...]` at `slot_mapping [T]` of `cache [num_blocks, block_size, ...]`."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def gather_from_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read `[len(slots), ...]` entries of `cache [num_blocks, block_size, ...]`."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, slots)


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
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention for every sequence of the step over its paged context.

    q `[T, Hq, D]`; caches `[num_blocks, block_size, Hkv, D]` already holding this step's K/V.
    Returns `[T, Hq, Dv]`. One sequence at a time: exact, and each sequence's result does not
    depend on what else is in the batch (batch invariance).
    """
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    start = 0
    for qlen, slots in zip(meta.query_lens, meta.context_slots):
        k = gather_from_cache(k_cache, slots)
        v = gather_from_cache(v_cache, slots)
        out[start : start + qlen] = causal_attention(q[start : start + qlen], k, v, scale, sliding_window)
        start += qlen
    return out
