"""DeepSeek-V4's attention kernels over its paged caches: shared-KV attention with sinks over a
sliding window plus compressed entries, and the lightning indexer's top-k of the entries.

`sink_attention`: query t, at position p of sequence s, attends (one key per row, also its value)
to the window's keys at positions max(0, p - window + 1) .. p, read from the window cache through
s's window block table, then to the compressed entries closed at p (e < (p + 1) // ratio), read
from the entry cache through s's entry table: every one of them (HCA), or the indices the indexer
chose (CSA, `[T, K]` int32, -1: none). One program per (token, tile of heads) walks the two
ranges in tiles of `BLOCK_N` rows with the FlashAttention-2 online softmax in base 2 and float32.
The head's sink logit starts the running max and sum (a key of weight exp(sink) and no value), so
a query with no key yet still gets a defined result and no tile has to guard against an all -inf
running max.

`indexer_topk`: V4's indexer scores are DSA's (`sum_h w_h * relu(scale * q_h . k)`), so they run
on `sparse_mla`'s score kernel, each query's last visible key being its last closed entry; the
top `top_k` of them by `torch.topk` (-1 where a query sees fewer entries).

The torch reference is `ops.compressed_attention`; tests/kernels/test_compressed_attention.py
holds these to it under Triton's interpreter on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.paged_attention import LOG2E, cache_slots, dot_precision, online_softmax
from moeserve.kernels.sparse_mla import paged_key_scores

BLOCK_H = 16  # query heads per program: DeepSeek-V4-Flash's 64 heads are four programs per token
BLOCK_N = 32  # keys per tile: 32 rows of 512 bf16 are 32 KiB, as sparse MLA's latent tiles
NUM_WARPS = 8  # a 16 x 512 fp32 accumulator beside a 32 x 512 key tile, as `sparse_mla`
NO_ENTRIES, ALL_ENTRIES, CHOSEN_ENTRIES = 0, 1, 2  # the ENTRIES modes: window-only, HCA, CSA


@triton.jit
def _paged_rows(cache_ptr, table_ptr, seq, stride_t, index, ok, block_size, stride_b, stride_s, stride_d, dims, dim_ok):
    """Rows `index` (where `ok`, zeros elsewhere) of sequence `seq`'s rows of a paged cache."""
    block, offset = cache_slots(table_ptr, seq, stride_t, index, ok, block_size)
    return tl.load(
        cache_ptr + block[:, None] * stride_b + offset[:, None] * stride_s + dims[None, :] * stride_d,
        mask=ok[:, None] & dim_ok[None, :],
        other=0.0,
    )


@triton.jit
def _attend_tile(q, k, ok, m_i, l_i, acc, scale_log2, INPUT_PRECISION: tl.constexpr):
    """One tile of keys `k [BLOCK_N, D]` (rows where `ok`) into the running max, sum and output."""
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale_log2
    s = tl.where(ok[None, :], s, float("-inf"))
    p, alpha, m_new, l_new = online_softmax(s, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=INPUT_PRECISION)
    return m_new, l_new, acc


@triton.jit
def _sink_attention_kernel(
    q_ptr,
    sinks_log2_ptr,
    window_ptr,
    window_table_ptr,
    entries_ptr,
    entries_table_ptr,
    chosen_ptr,
    out_ptr,
    token_seq_ptr,
    token_pos_ptr,
    scale_log2,
    block_size,
    num_heads,
    window,
    ratio,
    topk,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wb,
    stride_ws,
    stride_wd,
    stride_wt,
    stride_eb,
    stride_es,
    stride_ed,
    stride_et,
    stride_ct,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ENTRIES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.load(token_seq_ptr + tok)
    pos = tl.load(token_pos_ptr + tok)
    dims = tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_N)
    head_ok = heads < num_heads
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m_i = tl.load(sinks_log2_ptr + heads, mask=head_ok, other=0.0)
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for first in range(tl.maximum(pos - window + 1, 0), pos + 1, BLOCK_N):
        key_pos = first + rows
        ok = key_pos <= pos
        k = _paged_rows(
            window_ptr,
            window_table_ptr,
            seq,
            stride_wt,
            key_pos,
            ok,
            block_size,
            stride_wb,
            stride_ws,
            stride_wd,
            dims,
            dim_ok,
        )
        m_i, l_i, acc = _attend_tile(q, k, ok, m_i, l_i, acc, scale_log2, INPUT_PRECISION)
    if ENTRIES != 0:
        closed = (pos + 1) // ratio
        count = closed
        if ENTRIES == 2:
            count = topk
        for first in range(0, count, BLOCK_N):
            entry = first + rows
            if ENTRIES == 2:
                entry = tl.load(chosen_ptr + tok * stride_ct + entry, mask=entry < topk, other=-1)
            ok = (entry >= 0) & (entry < closed)
            k = _paged_rows(
                entries_ptr,
                entries_table_ptr,
                seq,
                stride_et,
                entry,
                ok,
                block_size,
                stride_eb,
                stride_es,
                stride_ed,
                dims,
                dim_ok,
            )
            m_i, l_i, acc = _attend_tile(q, k, ok, m_i, l_i, acc, scale_log2, INPUT_PRECISION)
    tl.store(
        out_ptr + tok * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


def sink_attention(
    q: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    window_cache: torch.Tensor,
    window_table: torch.Tensor,
    window: int,
    entries: tuple[torch.Tensor, torch.Tensor, int] | None,
    chosen: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """q `[T, Hq, D]` at positions `token_pos [T]` of sequences `token_seq [T]` (int32, rows of
    the block tables), sinks `[Hq]` float32; the window cache `[N, B, D]` with its tables `[S,
    blocks]`; `entries`: the entry cache `[N', B, D]`, its tables and the tokens per entry (None:
    a window-only layer); `chosen [T, K]` int32 (-1: none) or None (every closed entry) ->
    `[T, Hq, D]` in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    if window_cache.shape[2] != head_dim or sinks.shape != (num_heads,):
        raise ValueError(f"q {tuple(q.shape)}, window {tuple(window_cache.shape)}, sinks {tuple(sinks.shape)} disagree")
    if chosen is not None and (entries is None or chosen.shape[0] != num_tokens):
        raise ValueError("a choice of entries needs the entries and one row per token")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    # Without entries (or a choice) the kernel never reads their pointers: the window's stand in.
    mode, ratio, topk = NO_ENTRIES, 1, 0
    entry_cache, entry_table, chosen_arg, chosen_stride = window_cache, window_table, token_pos, 0
    if entries is not None:
        entry_cache, entry_table, ratio = entries
        mode = ALL_ENTRIES
        if chosen is not None:
            mode, chosen_arg, chosen_stride, topk = CHOSEN_ENTRIES, chosen, chosen.stride(0), chosen.shape[1]
    _sink_attention_kernel[(num_tokens, triton.cdiv(num_heads, BLOCK_H))](
        q,
        sinks.float() * LOG2E,
        window_cache,
        window_table,
        entry_cache,
        entry_table,
        chosen_arg,
        out,
        token_seq,
        token_pos,
        scale * LOG2E,
        block_size,
        num_heads,
        window,
        ratio,
        topk,
        *q.stride(),
        *window_cache.stride(),
        window_table.stride(0),
        *entry_cache.stride(),
        entry_table.stride(0),
        chosen_stride,
        *out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_H=BLOCK_H,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
        ENTRIES=mode,
        INPUT_PRECISION=dot_precision(q.dtype),
        num_warps=NUM_WARPS,
    )
    return out


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    num_entries: int,
    ratio: int,
    top_k: int,
    block_size: int,
) -> torch.Tensor:
    """The indexer's queries `[T, Hi, Di]` and head weights `[T, Hi]` float32 (scaled by Hi **
    -0.5) at `token_pos` of `token_seq` over the indexer's entry cache `[N, B, Di]` (tables `[S,
    blocks]`; the step's sequences hold up to `num_entries` closed entries) -> each query's
    `min(top_k, num_entries)` best closed entries `[T, K]` int32, -1 past those it sees."""
    last_entry = ((token_pos + 1) // ratio - 1).to(torch.int32)
    scores = paged_key_scores(q, weights, key_cache, block_table, token_seq, last_entry, num_entries, block_size)
    best = scores.topk(min(top_k, num_entries), dim=-1)
    return best.indices.masked_fill(best.values == float("-inf"), -1).to(torch.int32)
