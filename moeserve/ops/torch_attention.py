"""Attention over the paged cache in plain torch: the reference every backend is held to, and the
CPU path.

One pass per layer for the whole step, prefill chunks and decodes together. The plan, made once
per step, sorts the step's sequences into buckets of equal shape and lays out one flat list of
cache slots holding every sequence's context; each layer gathers its K/V with that list once and
runs one `scaled_dot_product_attention` per bucket, over `[n, H, query_len, key_len]` with the
padded keys masked out. A step of 32 decodes is a handful of calls per layer, not 32 loops of
gather, einsum and softmax.

Why buckets rather than one batch padded to the step's longest context: batch invariance, a
sequence's result not depending on what else is in the step (the engine gives the same greedy
tokens batched or alone). Padding every sequence to its neighbours' longest context changes the
length of the reductions its softmax and `P @ V` run over, and with it the kernel's blocking and
summation order, so its bits would depend on the batch. Here a sequence's shape is a function of
its own lengths only: its query length exactly, its context length rounded up on a fixed grid
(`padded_context_len`). A bucket's kernel computes every (sequence, head) alike whatever else the
bucket holds, so a sequence gets the same bits in any step. The grid is geometric, a few steps
per octave of context length: few buckets (calls) per step, little padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.config import MLAConfig
from moeserve.ops.attention import AttentionBatch, AttentionPlan, gather_from_cache

MIN_PADDED_CONTEXT = 32
"""Contexts up to this many tokens share one bucket length: short prompts batch together."""

PADDED_CONTEXTS_PER_OCTAVE = 2
"""Bucket lengths per doubling of the context: 2 pads a context by less than half (257 -> 384),
and a decode step whose contexts span 64-300 tokens runs in at most 5 calls per layer. Measured
against 1 and 4 in bench/cpu_attention.py."""


def padded_context_len(context_len: int) -> int:
    """The key length a sequence of `context_len` tokens is padded to: a function of that length
    alone, so padding never depends on the rest of the step."""
    if context_len <= MIN_PADDED_CONTEXT:
        return MIN_PADDED_CONTEXT
    step = max(1, (1 << ((context_len - 1).bit_length() - 1)) // PADDED_CONTEXTS_PER_OCTAVE)
    return -(-context_len // step) * step


@dataclass(frozen=True)
class AttentionBucket:
    """Sequences of equal query length and padded context length: one attention call.

    rows:            offset of the bucket's `num_seqs * query_len` query rows in the plan's
                     bucket-ordered queries.
    keys:            offset of its `num_seqs * key_len` slots in the plan's `key_slots`.
    bias:            `[num_seqs, 1, query_len, key_len]` float32, added to the scores: 0 where a
                     query sees a key (an earlier or its own position), -inf elsewhere, padding
                     included.
    query_positions: `[num_seqs, 1, query_len, 1]` int64, each query's position: with the key
                     positions `arange(key_len)`, what a sliding window needs.
    """

    num_seqs: int
    query_len: int
    key_len: int
    rows: int
    keys: int
    bias: torch.Tensor
    query_positions: torch.Tensor

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """The additive mask, narrowed to the window's last `sliding_window` positions if any."""
        if sliding_window is None:
            return self.bias
        key_positions = torch.arange(self.key_len, device=self.bias.device)
        return self.bias.masked_fill(key_positions <= self.query_positions - sliding_window, float("-inf"))


@dataclass(frozen=True)
class TorchAttentionPlan(AttentionPlan):
    """query_lens:   per sequence, how many of its tokens are in this step (sum = T).
    context_lens: per sequence, its context length after this step.
    key_offsets:  per sequence, where its context starts in `key_slots`.
    key_slots:    `[N]` int64, every sequence's context slots in order, bucket by bucket, each
                  padded to its bucket's key length by repeating its first slot (always written,
                  so padded keys are finite; the mask hides them).
    query_rows:   `[T]` int64, the step's token rows in bucket order; None when that is the
                  step's own order (all sequences in one bucket, or buckets already in order).
    buckets:      the step's buckets, in the order of `key_slots` and `query_rows`.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    key_offsets: tuple[int, ...]
    key_slots: torch.Tensor
    query_rows: torch.Tensor | None
    buckets: tuple[AttentionBucket, ...]

    @property
    def context_slots(self) -> tuple[torch.Tensor, ...]:
        """Per sequence, `[context_len]` slots of its whole context, in order (views)."""
        return tuple(self.key_slots[o : o + n] for o, n in zip(self.key_offsets, self.context_lens))


def _padded_tables(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """`[B, max blocks]` int64, short tables padded with 0 (never read: positions stay in range)."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)


def torch_attention_plan(batch: AttentionBatch) -> TorchAttentionPlan:
    """Buckets, the flat slot list and the masks, built with a fixed number of tensor ops per
    step plus a few per bucket (no per-token Python), then moved to the batch's device."""
    query_lens, context_lens = batch.query_lens, batch.context_lens
    if any(q < 1 for q in query_lens):
        raise ValueError(f"every sequence needs query_len >= 1, got {list(query_lens)}")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        groups.setdefault((qlen, padded_context_len(ctx)), []).append(i)
    order = [i for members in groups.values() for i in members]
    key_lens = [padded_context_len(context_lens[i]) for i in order]
    key_starts = [0, *_cumsum(key_lens)]  # per sequence in bucket order
    key_offsets = [0] * len(order)
    for k, i in enumerate(order):
        key_offsets[i] = key_starts[k]
    if not order:
        empty = torch.zeros(0, dtype=torch.int64, device=batch.device)
        return TorchAttentionPlan(batch.slot_mapping, (), (), (), empty, None, ())

    order_t = torch.tensor(order, dtype=torch.int64)
    # Keys: sequence and position of each of the N padded entries, positions past a context
    # folded back to 0.
    key_lens_t = torch.tensor(key_lens, dtype=torch.int64)
    key_seq = order_t.repeat_interleave(key_lens_t)
    positions = torch.arange(key_starts[-1]) - torch.tensor(key_starts[:-1]).repeat_interleave(key_lens_t)
    positions = positions.masked_fill(positions >= torch.tensor(context_lens)[key_seq], 0)
    block_size = batch.block_size
    blocks = _padded_tables(batch.block_tables)[key_seq, positions // block_size]
    key_slots = blocks * block_size + positions % block_size
    # Queries: each token's row in the step and its position, in bucket order.
    qlens_t = torch.tensor([query_lens[i] for i in order], dtype=torch.int64)
    row_seq = order_t.repeat_interleave(qlens_t)
    first_rows = [0, *_cumsum(query_lens)]
    row_starts = torch.tensor([0, *_cumsum(qlens_t.tolist())][:-1]).repeat_interleave(qlens_t)
    offset_in_seq = torch.arange(len(row_seq)) - row_starts
    query_rows = torch.tensor(first_rows[:-1])[row_seq] + offset_in_seq
    query_positions = torch.tensor(batch.start_positions)[row_seq] + offset_in_seq

    device = batch.device
    buckets, rows, keys = [], 0, 0
    for (qlen, key_len), members in groups.items():
        n = len(members)
        q_pos = query_positions[rows : rows + n * qlen].view(n, 1, qlen, 1)
        visible = torch.arange(key_len) <= q_pos  # [n, 1, qlen, key_len]: causal, padding hidden
        bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        buckets.append(AttentionBucket(n, qlen, key_len, rows, keys, bias.to(device), q_pos.to(device)))
        rows += n * qlen
        keys += n * key_len
    in_order = order == sorted(order)
    return TorchAttentionPlan(
        slot_mapping=batch.slot_mapping,
        query_lens=query_lens,
        context_lens=context_lens,
        key_offsets=tuple(key_offsets),
        key_slots=key_slots.to(device),
        query_rows=None if in_order else query_rows.to(device),
        buckets=tuple(buckets),
    )


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The definition, one sequence at a time, that the batched path is tested against:
    attention of the last Lq context positions over all Lk of them.

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


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: TorchAttentionPlan,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q `[T, Hq, Dk]` over the plan's gathered keys `[N, Hkv, Dk]` and values `[N, Hkv, Dv]`:
    one call per bucket -> `[T, Hq, Dv]` in the step's token order."""
    num_heads, num_kv_heads, dv = q.shape[1], keys.shape[1], values.shape[-1]
    rows = q if plan.query_rows is None else q.index_select(0, plan.query_rows)
    outs = []
    for b in plan.buckets:  # [n, H, len, D] views of the gathered rows, sequence-major
        qb = rows[b.rows : b.rows + b.num_seqs * b.query_len].unflatten(0, (b.num_seqs, b.query_len)).transpose(1, 2)
        span = slice(b.keys, b.keys + b.num_seqs * b.key_len)
        kb = keys[span].unflatten(0, (b.num_seqs, b.key_len)).transpose(1, 2)
        vb = values[span].unflatten(0, (b.num_seqs, b.key_len)).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=b.mask(sliding_window), scale=scale, enable_gqa=num_heads != num_kv_heads
        )  # [n, Hq, Lq, Dv]
        outs.append(out.transpose(1, 2).reshape(b.num_seqs * b.query_len, num_heads, dv))
    if not outs:
        return q.new_empty(0, num_heads, dv)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.query_rows is None:
        return out
    return torch.empty_like(out).index_copy_(0, plan.query_rows, out)


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
    keys = gather_from_cache(k_cache, plan.key_slots)  # [N, Hkv, D]
    values = gather_from_cache(v_cache, plan.key_slots)  # [N, Hkv, Dv]
    return _attend(q, keys, values, plan, scale, sliding_window)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    kv_b_weight: torch.Tensor,
    mla: MLAConfig,
    scale: float,
) -> torch.Tensor:
    """MLA, expanded: the step's context latents through kv_b_proj (once per layer, every
    sequence together), then plain attention with the shared rope key on every head."""
    num_heads = q_nope.shape[1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    latent, k_rope = gather_from_cache(kv_cache, plan.key_slots).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    kv = F.linear(latent, kv_b_weight).view(latent.shape[0], num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, num_heads, -1)), dim=-1)
    return _attend(q, k, v, plan, scale, None)
