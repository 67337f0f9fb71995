"""Attention over the paged KV cache: one Triton kernel for prefill chunks and decode, plus a
split-KV ("flash decoding") launch of it for decode batches.

Numerics follow the torch reference `moeserve.ops.torch_attention.paged_attention`:
query i of a sequence sits at position `context_len - query_len + i` and sees the keys at
positions <= its own (and, with a sliding window W, > its own - W); scores and the softmax are
fp32; the probabilities are rounded to the value dtype before the product with V, which
accumulates in fp32. The softmax is the FlashAttention-2 online one (running max and sum, one
division at the end), so results differ from the reference only by rounding.

Layout of the work:

* GQA packing: one program serves all `Hq / Hkv` query heads of one KV head, for a tile of the
  sequence's query tokens. Its rows are (token, head) pairs, so every K/V tile read from the
  cache feeds the whole head group, and decode (one token) still gives the tensor cores a
  16-row operand when the group is smaller than that (rows past the group are masked).
* Paged reads: key tiles are walked by position; each key's physical block comes from the
  block table (`block_table[pos // block_size]`), so tiles need not line up with cache blocks
  and the context may be scattered over any blocks of the pool.
* Decode (every query length 1): the program grid also splits each sequence's context into
  fixed partitions of `decode_partition` keys, each partition reduced by its own program into
  a normalised partial output and its log-sum-exp, and `_combine_splits_kernel` merges them.
  Long contexts then use the whole GPU even at small batch. The partition size is a constant,
  not derived from the batch, so a sequence's result does not depend on what else is batched
  with it; a sequence whose context fits one partition is written directly, with no merge.

The step's new K/V are written by torch (`write_to_cache`) before the kernel runs; the kernels
only read the cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in base 2: exp2 is the hardware's native exponential
DECODE_PARTITION = 512  # keys per program in split-KV decode (vLLM's paged attention v2 uses 512 too)
PREFILL_ROWS = 64  # (token, head) rows per prefill program
BLOCK_N = 64  # keys per inner-loop tile
MIN_ROWS = 16  # smallest M of a tensor-core dot


@dataclass(frozen=True)
class PagedInputs:
    """What the attention kernels need about a step's sequences, built once per step.

    block_table:     `[B, max_blocks]` int32, physical block of each logical block, zero-padded.
    context_lens:    `[B]` int32, context length after this step (cached + new tokens).
    query_start:     `[B + 1]` int32, offsets of each sequence's tokens in the step's `[T]` rows.
    max_query_len, max_context_len, num_tokens, block_size: host ints. They size the launch
    grids and validate shapes; this is the one place host values are used, so the kernels
    never read a device tensor back to the CPU.
    """

    block_table: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    max_query_len: int
    max_context_len: int
    num_tokens: int
    block_size: int


def paged_inputs(
    block_tables: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str,
) -> PagedInputs:
    """Kernel inputs for sequences whose tokens [start, start + query_len) are in this step.

    Same arguments as `ops.attention.attention_batch`; every sequence must bring at least one token.
    """
    if not len(block_tables) == len(start_positions) == len(query_lens):
        raise ValueError(
            f"block_tables, start_positions and query_lens differ in length: {len(block_tables)}, "
            f"{len(start_positions)}, {len(query_lens)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    context_lens, query_start = [], [0]
    for i, (blocks, start, qlen) in enumerate(zip(block_tables, start_positions, query_lens)):
        if qlen < 1 or start < 0:
            raise ValueError(
                f"sequence {i}: query_len must be >= 1 and start >= 0, got query_len {qlen}, start {start}"
            )
        needed = -(-(start + qlen) // block_size)
        if len(blocks) < needed:
            raise ValueError(
                f"sequence {i}: block table holds {len(blocks)} blocks, positions up to {start + qlen} need {needed}"
            )
        context_lens.append(start + qlen)
        query_start.append(query_start[-1] + qlen)
    width = max((len(b) for b in block_tables), default=0)
    table = [list(b) + [0] * (width - len(b)) for b in block_tables]
    return PagedInputs(
        block_table=torch.tensor(table, dtype=torch.int32).reshape(len(table), width).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
        query_start=torch.tensor(query_start, dtype=torch.int32).to(device),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
        num_tokens=query_start[-1],
        block_size=block_size,
    )


# ---------------------------------------------------------------------------------------------
# Pieces shared with the MLA kernel (moeserve/kernels/mla_attention.py)
# ---------------------------------------------------------------------------------------------


@triton.jit
def key_range(
    context_len,
    query_len,
    tile,
    split,
    window,
    BLOCK_Q: tl.constexpr,
    PARTITION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Keys [lo, hi) a query tile can see, and (split-KV) the part of them this program takes.

    Returns lo, hi and the number of partitions the tile's range has (1 without split-KV).
    """
    first_pos = context_len - query_len + tile * BLOCK_Q
    hi = tl.minimum(context_len, first_pos + BLOCK_Q)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    num_splits = 1
    if PARTITION > 0:
        num_splits = tl.cdiv(hi - lo, PARTITION)
        lo = lo + split * PARTITION
        hi = tl.minimum(hi, lo + PARTITION)
    return lo, hi, num_splits


@triton.jit
def cache_slots(block_table_ptr, seq, stride_bt, key_pos, key_ok, block_size):
    """Physical block and slot in that block of sequence `seq`'s keys at `key_pos` (int64: a
    large pool's element offsets overflow int32)."""
    block = tl.load(block_table_ptr + seq * stride_bt + key_pos // block_size, mask=key_ok, other=0).to(tl.int64)
    return block, (key_pos % block_size).to(tl.int64)


@triton.jit
def online_softmax(s, m_i, l_i):
    """One FlashAttention-2 step on base-2 scores `s` (masked ones -inf): the tile's
    probabilities, the factor rescaling earlier sums, and the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def store_result(
    acc,
    m_i,
    l_i,
    row_tok,
    row_head,
    row_ok,
    cols,
    col_ok,
    split,
    num_splits,
    out_ptr,
    stride_ot,
    stride_oh,
    stride_od,
    part_out_ptr,
    part_lse_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
):
    """Write the normalised output of each row, or, when the sequence's context was split over
    several programs, this partition's normalised output and log-sum-exp (base 2) for the merge."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # padding rows saw no key
    o = acc / l_safe[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    row_tok = row_tok.to(tl.int64)
    if num_splits > 1:
        base = row_tok * stride_pt + row_head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] + cols[None, :], o, mask=mask)
        tl.store(part_lse_ptr + row_tok * stride_lt + row_head * stride_lh + split, m_i + tl.log2(l_safe), mask=row_ok)
    else:
        ptrs = out_ptr + row_tok[:, None] * stride_ot + row_head[:, None] * stride_oh + cols[None, :] * stride_od
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    context_lens_ptr,
    window,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    stride_od,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PARTITION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """Decode: merge one (token, head)'s partition outputs, weighting each by its share of the
    softmax mass. Token t is sequence t (one token each). Single-partition rows are already done."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + tok)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(context_len - window, 0)
    num_splits = tl.cdiv(context_len - lo, PARTITION)
    if num_splits > 1:
        splits = tl.arange(0, MAX_SPLITS)
        split_ok = splits < num_splits
        cols = tl.arange(0, BLOCK_DV)
        tok64 = tok.to(tl.int64)
        lse = tl.load(part_lse_ptr + tok64 * stride_lt + head * stride_lh + splits, mask=split_ok, other=float("-inf"))
        weight = tl.exp2(lse - tl.max(lse, 0))
        base = tok64 * stride_pt + head * stride_ph + splits * stride_ps
        parts = tl.load(
            part_out_ptr + base[:, None] + cols[None, :], mask=split_ok[:, None] & (cols[None, :] < DV), other=0.0
        )
        o = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(
            out_ptr + tok64 * stride_ot + head * stride_oh + cols * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=cols < DV,
        )


def split_buffers(
    num_tokens: int, num_heads: int, num_splits: int, dv: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs `[T, H, splits, Dv]` and log-sum-exps `[T, H, splits]` for split-KV decode."""
    return (
        torch.empty(num_tokens, num_heads, num_splits, dv, dtype=torch.float32, device=device),
        torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device),
    )


def combine_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    inputs: PagedInputs,
    window: int | None,
    partition: int,
) -> None:
    """Merge split-KV decode partials into `out [T, H, Dv]` (rows with one partition are skipped)."""
    num_tokens, num_heads, num_splits, dv = part_out.shape
    _combine_splits_kernel[(num_tokens, num_heads)](
        part_out,
        part_lse,
        out,
        inputs.context_lens,
        window or 0,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        DV=dv,
        BLOCK_DV=triton.next_power_of_2(dv),
        PARTITION=partition,
        MAX_SPLITS=triton.next_power_of_2(num_splits),
        HAS_WINDOW=window is not None,
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact (IEEE) products rather than the tensor cores' TF32 default, so a
    fp32 run matches the fp32 reference; fp16/bf16 products are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_inputs(q: torch.Tensor, inputs: PagedInputs, scale: float) -> None:
    """Checks shared by both attention wrappers."""
    if q.shape[0] != inputs.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens but the step's query lengths add up to {inputs.num_tokens}")
    if inputs.block_table.device != q.device:
        raise ValueError(f"paged inputs are on {inputs.block_table.device} but q is on {q.device}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")


# ---------------------------------------------------------------------------------------------
# GQA / MHA attention
# ---------------------------------------------------------------------------------------------


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_table_ptr,
    context_lens_ptr,
    query_start_ptr,
    qk_scale,
    window,
    block_size,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PARTITION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Grid: (query tiles, or partitions when PARTITION > 0; sequences; KV heads).

    Row r of a program is query token `tile * BLOCK_Q + r // GROUP_P` and query head
    `kv_head * GROUP + r % GROUP_P` (GROUP_P: the group size rounded up to a power of two).
    """
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_begin
    context_len = tl.load(context_lens_ptr + seq)
    if PARTITION > 0:
        tile = 0
        split = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        split = 0
    lo, hi, num_splits = key_range(context_len, query_len, tile, split, window, BLOCK_Q, PARTITION, HAS_WINDOW)
    if (query_len > tile * BLOCK_Q) & (num_splits > split):
        rows = tl.arange(0, BLOCK_M)
        tok = tile * BLOCK_Q + rows // GROUP_P
        head_in_group = rows % GROUP_P
        row_ok = (rows < BLOCK_Q * GROUP_P) & (tok < query_len) & (head_in_group < GROUP)
        head = kv_head * GROUP + head_in_group
        q_pos = context_len - query_len + tok
        row_tok = q_begin + tok

        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q_ptrs = q_ptr + row_tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (dk[None, :] < DK), other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles give p = 0, not NaN
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            key_ok = key_pos < hi
            block, in_block = cache_slots(block_table_ptr, seq, stride_bt, key_pos, key_ok, block_size)
            k_slot = block * stride_kb + in_block * stride_ks
            k = tl.load(
                k_ptr + k_slot[None, :] + kv_head * stride_kh + dk[:, None] * stride_kd,
                mask=key_ok[None, :] & (dk[:, None] < DK),
                other=0.0,
            )  # [BLOCK_DK, BLOCK_N]
            s = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale
            visible = key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
            v_slot = block * stride_vb + in_block * stride_vs
            v = tl.load(
                v_ptr + v_slot[:, None] + kv_head * stride_vh + dv[None, :] * stride_vd,
                mask=key_ok[:, None] & (dv[None, :] < DV),
                other=0.0,
            )  # [BLOCK_N, BLOCK_DV]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)

        store_result(
            acc,
            m_i,
            l_i,
            row_tok,
            head,
            row_ok,
            dv,
            dv < DV,
            split,
            num_splits,
            out_ptr,
            stride_ot,
            stride_oh,
            stride_od,
            part_out_ptr,
            part_lse_ptr,
            stride_pt,
            stride_ph,
            stride_ps,
            stride_lt,
            stride_lh,
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: PagedInputs,
    scale: float,
    sliding_window: int | None = None,
    *,
    decode_partition: int = DECODE_PARTITION,
) -> torch.Tensor:
    """Attention of the step's queries over their paged context (GQA, MHA or MQA).

    q `[T, Hq, D]`; k_cache `[num_blocks, block_size, Hkv, D]` and v_cache
    `[num_blocks, block_size, Hkv, Dv]`, already holding this step's K/V; any strides (the two
    halves of a `[2, ...]` cache, or a q sliced out of a fused projection, need no copy).
    Returns `[T, Hq, Dv]` in q's dtype.

    A step of decodes only (every query length 1) runs split-KV with `decode_partition` keys per
    program; any other step runs one program per (query tile, sequence, KV head).
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"expected q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in blocks, block size or heads"
        )
    num_tokens, num_heads, dk = q.shape
    num_kv_heads, dv = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != dk:
        raise ValueError(f"q head dim {dk} differs from the key cache's {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not q.device == k_cache.device == v_cache.device:
        raise ValueError(
            f"q, k_cache and v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}"
        )
    if k_cache.shape[1] != inputs.block_size:
        raise ValueError(f"cache block size {k_cache.shape[1]} differs from the paged inputs' {inputs.block_size}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if decode_partition < 1:
        raise ValueError(f"decode_partition must be positive, got {decode_partition}")
    check_inputs(q, inputs, scale)

    out = q.new_empty(num_tokens, num_heads, dv)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    if inputs.max_query_len == 1:
        block_q, partition = 1, decode_partition
        visible = min(inputs.max_context_len, sliding_window or inputs.max_context_len)
        num_splits = triton.cdiv(visible, partition)
        grid_0 = num_splits
    else:
        block_q, partition, num_splits = max(1, PREFILL_ROWS // group_p), 0, 1
        grid_0 = triton.cdiv(inputs.max_query_len, block_q)
    block_m = max(MIN_ROWS, block_q * group_p)
    part_out, part_lse = (
        split_buffers(num_tokens, num_heads, num_splits, dv, q.device) if num_splits > 1 else (out, out)
    )
    _paged_attention_kernel[(grid_0, len(inputs.context_lens), num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        inputs.block_table,
        inputs.context_lens,
        inputs.query_start,
        scale * LOG2E,
        sliding_window or 0,
        inputs.block_size,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        inputs.block_table.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        GROUP=group,
        GROUP_P=group_p,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        DK=dk,
        DV=dv,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        PARTITION=partition,
        HAS_WINDOW=sliding_window is not None,
        INPUT_PRECISION=dot_precision(q.dtype),
    )
    if num_splits > 1:
        combine_splits(part_out, part_lse, out, inputs, sliding_window, partition)
    return out
