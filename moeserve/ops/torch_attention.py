"""Attention over the paged cache in plain torch: the reference every backend is held to, and the
CPU path.

One pass per layer for the whole step, prefill chunks and decodes together. The plan, made once
per step, sorts the step's sequences into buckets of equal shape and lays out one flat list of
cache slots holding every sequence's context; each layer gathers its K/V with that list once and
runs each bucket as one batched attention (`bucket_attention`: two batched matrix products and a
softmax over `[n, H, query_len, key_len]`, padded keys masked out). A step of 32 decodes is a
handful of calls per layer, not 32 rounds of gather, einsum and softmax.

Why buckets rather than one batch padded to the step's longest context: batch invariance, a
sequence's result not depending on what else is in the step (the engine gives the same greedy
tokens batched or alone). Padding every sequence to its neighbours' longest context changes the
length of the reductions its softmax and `P @ V` run over, and with them the kernels' blocking
and summation order, so its bits would depend on the batch. Here a sequence's shape is a function
of its own lengths only (`bucket_key_len`): its query length exactly, a decode's context length
rounded up on a fixed geometric grid (`padded_context_len`), a chunk's exactly. A bucket's batched
products compute every sequence's matrices alike whatever else the bucket holds, so a sequence
gets the same bits in any step (tests/kernels/test_torch_attention.py checks it bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from moeserve.config import MLAConfig
from moeserve.ops.attention import AttentionBatch, AttentionPlan, DecodeGraphInputs, gather_from_cache
from moeserve.ops.host_ints import int64_tensor

MIN_PADDED_CONTEXT = 32
"""Decodes with contexts up to this many tokens share one bucket length."""

PADDED_CONTEXTS_PER_OCTAVE = 2
"""Bucket lengths per doubling of the context: 2 pads a context by less than half (257 -> 384),
and a decode step whose contexts span 64-300 tokens runs in at most 5 calls per layer. In
bench/cpu_attention.py, 1 (padding up to 2x) was up to 3x slower on 32 decodes, and 4 (twice
the calls) within the shared machine's noise of 2 either way."""


def padded_context_len(context_len: int) -> int:
    """The key length a sequence of `context_len` tokens is padded to: a function of that length
    alone, so padding never depends on the rest of the step."""
    if context_len <= MIN_PADDED_CONTEXT:  # short contexts: one bucket, little absolute padding
        return MIN_PADDED_CONTEXT
    step = max(1, (1 << ((context_len - 1).bit_length() - 1)) // PADDED_CONTEXTS_PER_OCTAVE)
    return -(-context_len // step) * step


def bucket_key_len(query_len: int, context_len: int) -> int:
    """A sequence's key length in its bucket. Decodes are padded, so that decodes of nearby
    lengths share a call. A multi-token chunk is not: it shares a bucket only with chunks of its
    own query length, which prompts of one length already do unpadded, and padding would add
    work that grows with its query length."""
    return padded_context_len(context_len) if query_len == 1 else context_len


def padded_context_lens(max_context_len: int) -> tuple[int, ...]:
    """Every length `padded_context_len` gives a context of 1..max_context_len tokens, ascending:
    the grid's points, found by jumping from one to the next (a handful per doubling)."""
    lengths = [padded_context_len(1)]
    while lengths[-1] < max_context_len:
        lengths.append(padded_context_len(lengths[-1] + 1))
    return tuple(lengths)


@dataclass(frozen=True)
class AttentionBucket:
    """Sequences of equal query length and padded context length: one attention call.

    rows:            offset of the bucket's `num_seqs * query_len` query rows in the plan's
                     bucket-ordered queries.
    keys:            offset of its `num_seqs * key_stride` slots in the plan's `key_slots`.
    bias:            `[num_seqs, 1, query_len, key_len]` float32, added to the scores: 0 where a
                     query sees a key (an earlier or its own position), -inf elsewhere, padding
                     included.
    query_positions: `[num_seqs, 1, query_len, 1]` int64, each query's position: with the key
                     positions `arange(key_len)`, what a sliding window needs.
    key_stride:      slots each sequence has in `key_slots` (its first key_len are the bucket's);
                     None: key_len. Larger in a captured decode step, whose buckets share one
                     gather of every sequence's context at the longest length.
    """

    num_seqs: int
    query_len: int
    key_len: int
    rows: int
    keys: int
    bias: torch.Tensor
    query_positions: torch.Tensor
    key_stride: int | None = None

    def rows_of(self, queries: torch.Tensor) -> torch.Tensor:
        """This bucket's `[n, query_len, ...]` of the step's bucket-ordered `[T, ...]` queries."""
        return queries[self.rows : self.rows + self.num_seqs * self.query_len].unflatten(
            0, (self.num_seqs, self.query_len)
        )

    def keys_of(self, gathered: torch.Tensor) -> torch.Tensor:
        """This bucket's `[n, key_len, ...]` of the plan's gathered `[N, ...]` keys or values,
        contiguous as an eager bucket's are (a product's arithmetic may follow its operands' strides)."""
        stride = self.key_stride or self.key_len
        keys = gathered[self.keys : self.keys + self.num_seqs * stride].unflatten(0, (self.num_seqs, stride))
        return keys if stride == self.key_len else keys[:, : self.key_len].contiguous()

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
    output_rows:  `[T]` int64 or None. None: the buckets partition the tokens. Otherwise (a
                  captured decode step, `decode_graph_planner`) every bucket computes every token
                  and token t takes row `output_rows[t]` of the buckets' outputs laid end to end;
                  the host tuples above are then empty, the lengths living on the device.
    """

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    key_offsets: tuple[int, ...]
    key_slots: torch.Tensor
    query_rows: torch.Tensor | None
    buckets: tuple[AttentionBucket, ...]
    output_rows: torch.Tensor | None = None

    @property
    def context_slots(self) -> tuple[torch.Tensor, ...]:
        """Per sequence, `[context_len]` slots of its whole context, in order (views)."""
        return tuple(self.key_slots[o : o + n] for o, n in zip(self.key_offsets, self.context_lens))


def torch_attention_plan(batch: AttentionBatch) -> TorchAttentionPlan:
    """Buckets, the flat slot list and the masks: about twenty tensor ops per step and four per
    bucket, whatever the number of tokens (per-sequence numbers are spread over tokens by
    `repeat_interleave`, not by Python loops), then moved to the batch's device."""
    query_lens, context_lens = batch.query_lens, batch.context_lens
    if any(q < 1 for q in query_lens):
        raise ValueError(f"every sequence needs query_len >= 1, got {list(query_lens)}")
    seq_key_lens = [bucket_key_len(qlen, ctx) for qlen, ctx in zip(query_lens, context_lens)]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (qlen, key_len) in enumerate(zip(query_lens, seq_key_lens)):
        groups.setdefault((qlen, key_len), []).append(i)
    order = [i for members in groups.values() for i in members]  # sequences in bucket order
    key_lens = [seq_key_lens[i] for i in order]
    key_starts = list(accumulate(key_lens, initial=0))
    key_offsets = [0] * len(order)
    for k, i in enumerate(order):
        key_offsets[i] = key_starts[k]
    if not order:
        empty = torch.zeros(0, dtype=torch.int64, device=batch.device)
        return TorchAttentionPlan(batch.slot_mapping, (), (), (), empty, None, ())

    key_slots = _key_slots(batch, context_lens, order, key_lens, key_starts)
    # Queries: each token's row in the step and its position, in bucket order.
    query_lens_in_order = [query_lens[i] for i in order]
    first_rows = list(accumulate(query_lens, initial=0))
    per_seq = int64_tensor(
        chain(
            accumulate(query_lens_in_order[:-1], initial=0),
            (first_rows[i] for i in order),
            (batch.start_positions[i] for i in order),
        )
    ).view(3, -1)
    if first_rows[-1] > len(order):  # some sequence brings several tokens: spread over them
        per_seq = per_seq.repeat_interleave(int64_tensor(query_lens_in_order), dim=1)
    row_start, first_row, start_position = per_seq
    offset = torch.arange(first_rows[-1]) - row_start  # [T]: the token's index in its sequence's chunk
    query_positions = start_position + offset
    in_order = order == sorted(order)

    device = batch.device
    key_positions = torch.arange(max(key_lens))
    buckets, rows, keys = [], 0, 0
    for (qlen, key_len), members in groups.items():
        n = len(members)
        q_pos = query_positions[rows : rows + n * qlen].view(n, 1, qlen, 1)
        hidden = key_positions[:key_len] > q_pos  # [n, 1, qlen, key_len]: later positions, padding included
        bias = torch.where(hidden, float("-inf"), 0.0)
        buckets.append(AttentionBucket(n, qlen, key_len, rows, keys, bias.to(device), q_pos.to(device)))
        rows += n * qlen
        keys += n * key_len
    return TorchAttentionPlan(
        slot_mapping=batch.slot_mapping,
        query_lens=query_lens,
        context_lens=context_lens,
        key_offsets=tuple(key_offsets),
        key_slots=key_slots.to(device),
        query_rows=None if in_order else (first_row + offset).to(device),
        buckets=tuple(buckets),
    )


def decode_graph_planner(inputs: DecodeGraphInputs) -> Callable[[], TorchAttentionPlan]:
    """A captured decode step's plan, bit for bit the eager one for every sequence.

    Eager, a decode of context c runs in a bucket of key length `padded_context_len(c)`; captured,
    the lengths live on the device and a bucket's shape must be fixed. So every grid length up to
    `max_context_len` is a bucket of all B sequences (one gather of each context at the longest
    length, each bucket its first L keys, masked as eager masks them), and each sequence takes the
    output of the bucket eager would have put it in: the same shapes, so the same arithmetic
    (batched products give a matrix the same bits at any batch size). It costs B sequences times
    the grid's lengths (about 3.5x the longest) per layer: the reference path, not the fast one.
    """
    lengths = padded_context_lens(inputs.max_context_len)
    device, num_seqs, block_size = inputs.slot_mapping.device, inputs.num_seqs, inputs.block_size
    longest = lengths[-1]
    grid = torch.tensor(lengths, dtype=torch.int32, device=device)  # uploaded once, before capture
    key_positions = torch.arange(longest, device=device)  # [K]
    seq_rows = torch.arange(num_seqs, device=device)  # [B]

    def plan() -> TorchAttentionPlan:
        context_lens = inputs.context_lens.long()  # [B]
        last = (context_lens - 1).view(num_seqs, 1, 1, 1)  # each query's position
        positions = key_positions.expand(num_seqs, longest).masked_fill(key_positions >= context_lens[:, None], 0)
        blocks = inputs.block_table.long().gather(1, positions // block_size)  # [B, K]
        key_slots = (blocks * block_size + positions % block_size).reshape(-1)  # [B * K]
        buckets = tuple(
            AttentionBucket(
                num_seqs=num_seqs,
                query_len=1,
                key_len=length,
                rows=0,
                keys=0,
                bias=torch.where(key_positions[:length] > last, float("-inf"), 0.0),
                query_positions=last,
                key_stride=longest,
            )
            for length in lengths
        )
        bucket = torch.searchsorted(grid, inputs.context_lens)  # [B]: the first length >= the context
        return TorchAttentionPlan(
            slot_mapping=inputs.slot_mapping,
            query_lens=(),
            context_lens=(),
            key_offsets=(),
            key_slots=key_slots,
            query_rows=None,
            buckets=buckets,
            output_rows=bucket * num_seqs + seq_rows,
        )

    return plan


def _key_slots(
    batch: AttentionBatch, context_lens: tuple[int, ...], order: list[int], key_lens: list[int], key_starts: list[int]
) -> torch.Tensor:
    """`[N]` slots of the sequences `order` in turn, each over its `key_lens` entries starting at
    `key_starts`: per entry its sequence's offsets, then its position (past the context: folded
    back to 0, its first slot) and that position's slot."""
    block_size = batch.block_size
    table_starts = list(accumulate((len(t) for t in batch.block_tables), initial=0))
    per_seq = int64_tensor(
        chain(key_starts[:-1], (context_lens[i] for i in order), (table_starts[i] for i in order))
    ).view(3, -1)
    key_start, context_len, table_start = per_seq.repeat_interleave(int64_tensor(key_lens), dim=1)  # [N] each
    positions = torch.arange(key_starts[-1]) - key_start
    positions.masked_fill_(positions >= context_len, 0)
    tables = int64_tensor(chain.from_iterable(batch.block_tables))
    return tables[table_start + positions // block_size] * block_size + positions % block_size


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


def bucket_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One bucket: q `[n, Lq, Hq, Dk]`, k `[n, K, Hkv, Dk]`, v `[n, K, Hkv, Dv]`, additive mask
    `[n, 1, Lq, K]`, optional per-head sink logits `[Hq]` -> `[n * Lq, Hq, Dv]`.

    A sink is one more column of scores that every query of its head sees; it is dropped after
    the softmax, so it only takes probability mass from the real keys (gpt-oss).

    The definition's arithmetic (scores in the inputs' dtype, softmax in float32, batched matrix
    products), with each KV head's query heads stacked as rows of one product instead of K/V
    repeated per query head. Why not `scaled_dot_product_attention`: its fused CPU kernel splits
    the keys among threads when a call has fewer (sequence, head) tasks than threads, so the
    same sequence's bits differ with the bucket's size (measured: 38 of 378 shapes with 2
    threads); batched matrix products give each matrix the same arithmetic at any batch size.
    """
    n, lq, num_heads, dk = q.shape
    key_len, num_kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = num_heads // num_kv_heads
    # Operands contiguous in one layout: a product's arithmetic can follow its operands' strides,
    # and views of a one-sequence bucket are strided unlike a larger bucket's.
    rows = q.unflatten(2, (num_kv_heads, group)).permute(0, 2, 3, 1, 4).contiguous()  # [n, Hkv, G, Lq, Dk]
    keys = k.transpose(1, 2).contiguous()  # [n, Hkv, K, Dk]
    scores = torch.matmul(rows.view(n, num_kv_heads, group * lq, dk), keys.transpose(-1, -2)) * scale
    scores = scores.view(n, num_kv_heads, group, lq, key_len) + bias.unsqueeze(2)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, num_kv_heads, group, 1, 1).expand(n, -1, -1, lq, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(v.dtype)
    values = v.transpose(1, 2).contiguous()  # [n, Hkv, K, Dv]
    out = torch.matmul(probs.view(n, num_kv_heads, group * lq, key_len), values)  # [n, Hkv, G * Lq, Dv]
    return out.view(n, num_kv_heads, group, lq, dv).permute(0, 3, 1, 2, 4).reshape(n * lq, num_heads, dv)


def _each_bucket(
    q: torch.Tensor, plan: TorchAttentionPlan, attend: Callable[[AttentionBucket, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """q `[T, Hq, Dk]`, bucket by bucket (at least one): `attend(bucket, its queries [n, Lq, Hq,
    Dk])` gives `[n * Lq, Hq, Dv]`; the outputs go back to the step's token order -> `[T, Hq, Dv]`."""
    return step_order([attend(b, qb) for b, qb in zip(plan.buckets, bucket_rows(q, plan))], plan)


def bucket_rows(x: torch.Tensor, plan: TorchAttentionPlan) -> list[torch.Tensor]:
    """`x [T, ...]` (the step's tokens in order) as each bucket's `[n, query_len, ...]`."""
    rows = x if plan.query_rows is None else x.index_select(0, plan.query_rows)
    return [b.rows_of(rows) for b in plan.buckets]


def step_order(outs: list[torch.Tensor], plan: TorchAttentionPlan) -> torch.Tensor:
    """The buckets' outputs `[n * query_len, ...]` each (at least one), back in the step's token
    order -> `[T, ...]`."""
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.output_rows is not None:
        return out.index_select(0, plan.output_rows)
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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for every sequence of the step over its paged context.

    q `[T, Hq, D]`; caches `[num_blocks, block_size, Hkv, D]` already holding this step's K/V;
    sinks `[Hq]` or None (see `bucket_attention`). Returns `[T, Hq, Dv]`.
    """
    keys = gather_from_cache(k_cache, plan.key_slots)  # [N, Hkv, D]
    values = gather_from_cache(v_cache, plan.key_slots)  # [N, Hkv, Dv]

    def attend(b: AttentionBucket, qb: torch.Tensor) -> torch.Tensor:
        return bucket_attention(qb, b.keys_of(keys), b.keys_of(values), b.mask(sliding_window), scale, sinks)

    if not plan.buckets:
        return q.new_empty(0, q.shape[1], v_cache.shape[-1])
    return _each_bucket(q, plan, attend)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    kv_b_weight: torch.Tensor,
    mla: MLAConfig,
    scale: float,
) -> torch.Tensor:
    """MLA, expanded: each bucket's context latents through kv_b_proj, then plain attention with
    the shared rope key on every head.

    The expansion is a batched product per bucket (`bmm` with the weight broadcast), not one
    `F.linear` over the step's latents: a linear's rows come out with bits that depend on how
    many rows it has (measured on this CPU), which would tie a sequence's keys to the step.
    """
    num_heads = q_nope.shape[1]
    q = torch.cat((q_nope, q_rope), dim=-1)
    latents = gather_from_cache(kv_cache, plan.key_slots)  # [N, kv_lora_rank + rope]
    weight = kv_b_weight.t()  # [kv_lora_rank, H * (nope + v)]

    def attend(b: AttentionBucket, qb: torch.Tensor) -> torch.Tensor:
        return bucket_attention(qb, *expand_latents(b.keys_of(latents), weight, mla, num_heads), b.bias, scale)

    if not plan.buckets:
        return q.new_empty(0, num_heads, mla.v_head_dim)
    return _each_bucket(q, plan, attend)


def expand_latents(
    latents: torch.Tensor, weight: torch.Tensor, mla: MLAConfig, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's context latents `[n, K, kv_lora_rank + rope]` through kv_b_proj (`weight`, its
    transpose `[kv_lora_rank, H * (nope + v)]`) -> keys `[n, K, H, nope + rope]` (the shared rope
    key on every head) and values `[n, K, H, v]`."""
    latent, k_rope = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    kv = torch.bmm(latent, weight.expand(latents.shape[0], -1, -1))  # [n, K, H * (nope + v)]
    k_nope, v = kv.unflatten(-1, (num_heads, -1)).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    return torch.cat((k_nope, k_rope[:, :, None, :].expand(-1, -1, num_heads, -1)), dim=-1), v
