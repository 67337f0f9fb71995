"""DeepSeek MLA attention over the paged latent cache, in the absorbed form.

The cache holds per token the normalised KV latent `c [kv_lora_rank]` and the rotated shared
rope key `k_rope [qk_rope_head_dim]`. The reference (`MLAttention`) expands every context latent
through kv_b_proj into per-head keys and values, `k_nope = W_UK c`, `v = W_UV c`. Because both
are linear in c, they can be moved onto the query and the output instead (DeepSeek-V2's
"absorption"):

    q_nope . (W_UK c) = (q_nope W_UK) . c = q_latent . c
    sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j) = W_UV out_latent

so attention runs directly on the cached latents, as multi-query attention with one shared
"head" of dimension kv_lora_rank + rope for keys and kv_lora_rank for values (the same bytes:
V is the first part of K). Per step this costs one small bmm per head on each side instead of
expanding the whole context per layer, and the kernel reads 576 values per context token
(DeepSeek-V3) instead of 128 heads x 320.

The kernel runs every step shape: prefill chunks with causal masking, and decode with split-KV
over long contexts. It is built for decode, though: for long prefills the absorbed form does more
arithmetic than the expanded one (each score is a 576-long dot instead of 192, and every value
is 512 wide instead of 128), so whether those should take the expanded path is the caller's call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.config import MLAConfig
from moeserve.kernels.paged_attention import (
    DECODE_PARTITION,
    LOG2E,
    MIN_ROWS,
    PagedInputs,
    cache_slots,
    check_inputs,
    combine_splits,
    dot_precision,
    key_range,
    online_softmax,
    split_buffers,
    store_result,
)

BLOCK_H = 16  # heads per program (rows of the tensor-core tile in decode)
BLOCK_N = 32  # keys per tile: 32 latents of 512 bf16 are 32 KiB of shared memory
PREFILL_ROWS = 32  # (token, head) rows per prefill program
NUM_WARPS = 8  # a 32 x 512 fp32 accumulator spills on 4 warps (sm_90 build: 255 registers), not on 8 (194)


@triton.jit
def _mla_attention_kernel(
    q_lat_ptr,
    q_rope_ptr,
    cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_table_ptr,
    context_lens_ptr,
    query_start_ptr,
    qk_scale,
    block_size,
    num_heads,
    stride_qlt,
    stride_qlh,
    stride_qld,
    stride_qrt,
    stride_qrh,
    stride_qrd,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    HEADS_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_LORA: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    PARTITION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """Grid: (query tiles, or partitions when PARTITION > 0; sequences; head tiles).

    Row r of a program is query token `tile * BLOCK_Q + r // HEADS_P` and head
    `head_tile * HEADS_P + r % HEADS_P`. Each latent tile is loaded once and used twice: as keys
    (with its rope part) and as values.
    """
    seq = tl.program_id(1)
    head_tile = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_begin
    context_len = tl.load(context_lens_ptr + seq)
    if PARTITION > 0:
        tile = 0
        split = tl.program_id(0)
    else:
        tile = tl.program_id(0)
        split = 0
    lo, hi, num_splits = key_range(context_len, query_len, tile, split, 0, BLOCK_Q, PARTITION, False)
    if (query_len > tile * BLOCK_Q) & (num_splits > split):
        rows = tl.arange(0, BLOCK_M)
        tok = tile * BLOCK_Q + rows // HEADS_P
        head = head_tile * HEADS_P + rows % HEADS_P
        row_ok = (rows < BLOCK_Q * HEADS_P) & (tok < query_len) & (head < num_heads)
        q_pos = context_len - query_len + tok
        row_tok = (q_begin + tok).to(tl.int64)

        dl = tl.arange(0, BLOCK_LORA)
        dr = tl.arange(0, BLOCK_ROPE)
        lora_ok = dl < LORA
        rope_ok = dr < ROPE
        q_lat = tl.load(
            q_lat_ptr + row_tok[:, None] * stride_qlt + head[:, None] * stride_qlh + dl[None, :] * stride_qld,
            mask=row_ok[:, None] & lora_ok[None, :],
            other=0.0,
        )
        q_rope = tl.load(
            q_rope_ptr + row_tok[:, None] * stride_qrt + head[:, None] * stride_qrh + dr[None, :] * stride_qrd,
            mask=row_ok[:, None] & rope_ok[None, :],
            other=0.0,
        )

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked tiles give p = 0, not NaN
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_LORA], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            key_ok = key_pos < hi
            block, in_block = cache_slots(block_table_ptr, seq, stride_bt, key_pos, key_ok, block_size)
            slot = block * stride_cb + in_block * stride_cs
            latent = tl.load(
                cache_ptr + slot[:, None] + dl[None, :] * stride_cd, mask=key_ok[:, None] & lora_ok[None, :], other=0.0
            )
            k_rope = tl.load(
                cache_ptr + slot[:, None] + (LORA + dr[None, :]) * stride_cd,
                mask=key_ok[:, None] & rope_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q_lat, tl.trans(latent), input_precision=INPUT_PRECISION)
            s = tl.dot(q_rope, tl.trans(k_rope), acc=s, input_precision=INPUT_PRECISION) * qk_scale
            s = tl.where(key_ok[None, :] & (key_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax(s, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=INPUT_PRECISION)

        store_result(
            acc,
            m_i,
            l_i,
            row_tok,
            head,
            row_ok,
            dl,
            lora_ok,
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


def mla_latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    inputs: PagedInputs,
    scale: float,
    kv_lora_rank: int,
    *,
    decode_partition: int = DECODE_PARTITION,
) -> torch.Tensor:
    """Latent attention: `softmax((q_latent . c + q_rope . k_rope) * scale) . c` per head.

    q_latent `[T, H, kv_lora_rank]`, q_rope `[T, H, rope]` (any strides), kv_cache
    `[num_blocks, block_size, kv_lora_rank + rope]`. Returns out_latent `[T, H, kv_lora_rank]` in
    q's dtype, a view of a head-major `[H, T, kv_lora_rank]` tensor. Decode-only steps run
    split-KV with `decode_partition` keys per program.
    """
    if q_latent.dim() != 3 or q_rope.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(
            f"expected q_latent [T, H, lora], q_rope [T, H, rope], kv_cache [num_blocks, block_size, lora + rope], "
            f"got {tuple(q_latent.shape)}, {tuple(q_rope.shape)}, {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, lora = q_latent.shape
    rope = q_rope.shape[2]
    if lora != kv_lora_rank or q_rope.shape[:2] != q_latent.shape[:2] or kv_cache.shape[2] != lora + rope:
        raise ValueError(
            f"shapes disagree with kv_lora_rank {kv_lora_rank}: q_latent {tuple(q_latent.shape)}, q_rope "
            f"{tuple(q_rope.shape)}, "
            f"kv_cache {tuple(kv_cache.shape)}"
        )
    if not q_latent.dtype == q_rope.dtype == kv_cache.dtype:
        raise ValueError(
            f"q_latent, q_rope and kv_cache must share a dtype, got {q_latent.dtype}, {q_rope.dtype}, {kv_cache.dtype}"
        )
    if not q_latent.device == q_rope.device == kv_cache.device:
        raise ValueError(
            f"q_latent, q_rope and kv_cache must be on one device, got {q_latent.device}, {q_rope.device}, "
            f"{kv_cache.device}"
        )
    if kv_cache.shape[1] != inputs.block_size:
        raise ValueError(f"cache block size {kv_cache.shape[1]} differs from the paged inputs' {inputs.block_size}")
    if decode_partition < 1:
        raise ValueError(f"decode_partition must be positive, got {decode_partition}")
    check_inputs(q_latent, inputs, scale)

    # Head-major storage: the un-absorbing bmm in `mla_decode` then reads it without a copy.
    out = q_latent.new_empty(num_heads, num_tokens, lora).transpose(0, 1)
    if num_tokens == 0:
        return out
    heads_p = min(BLOCK_H, triton.next_power_of_2(num_heads))
    if inputs.max_query_len == 1:
        block_q, partition = 1, decode_partition
        num_splits = triton.cdiv(inputs.max_context_len, partition)
        grid_0 = num_splits
    else:
        block_q, partition, num_splits = max(1, PREFILL_ROWS // heads_p), 0, 1
        grid_0 = triton.cdiv(inputs.max_query_len, block_q)
    part_out, part_lse = (
        split_buffers(num_tokens, num_heads, num_splits, lora, q_latent.device) if num_splits > 1 else (out, out)
    )
    _mla_attention_kernel[(grid_0, len(inputs.context_lens), triton.cdiv(num_heads, heads_p))](
        q_latent,
        q_rope,
        kv_cache,
        out,
        part_out,
        part_lse,
        inputs.block_table,
        inputs.context_lens,
        inputs.query_start,
        scale * LOG2E,
        inputs.block_size,
        num_heads,
        *q_latent.stride(),
        *q_rope.stride(),
        *kv_cache.stride(),
        *out.stride(),
        inputs.block_table.stride(0),
        *part_out.stride()[:3],
        *part_lse.stride()[:2],
        HEADS_P=heads_p,
        BLOCK_Q=block_q,
        BLOCK_M=max(MIN_ROWS, block_q * heads_p),
        BLOCK_N=BLOCK_N,
        LORA=lora,
        ROPE=rope,
        BLOCK_LORA=max(16, triton.next_power_of_2(lora)),
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        PARTITION=partition,
        INPUT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=NUM_WARPS,
    )
    if num_splits > 1:
        combine_splits(part_out, part_lse, out, inputs, None, partition)
    return out


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    inputs: PagedInputs,
    scale: float,
    mla_config: MLAConfig,
    *,
    decode_partition: int = DECODE_PARTITION,
) -> torch.Tensor:
    """MLA attention for the step's queries, absorbed: the result of `MLAttention`'s expanded
    attention, before o_proj.

    q_nope `[T, H, qk_nope_head_dim]`, q_rope `[T, H, qk_rope_head_dim]` (already rotated);
    kv_cache `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` holding this step's
    latents; kv_b_proj_weight `[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]` (this rank's
    heads, the layout of `MLAttention.kv_b_proj.weight`). Returns `[T, H, v_head_dim]`.
    Despite the name, prefill chunks (query lengths > 1) are supported too, causally masked.
    """
    m = mla_config
    if q_nope.dim() != 3 or q_rope.dim() != 3:
        raise ValueError(
            f"expected q_nope [T, H, nope] and q_rope [T, H, rope], got {tuple(q_nope.shape)}, {tuple(q_rope.shape)}"
        )
    num_tokens, num_heads, nope = q_nope.shape
    if nope != m.qk_nope_head_dim or q_rope.shape != (num_tokens, num_heads, m.qk_rope_head_dim):
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} / q_rope {tuple(q_rope.shape)} do not match qk_nope_head_dim "
            f"{m.qk_nope_head_dim}, "
            f"qk_rope_head_dim {m.qk_rope_head_dim}"
        )
    per_head = m.qk_nope_head_dim + m.v_head_dim
    if kv_b_proj_weight.shape != (num_heads * per_head, m.kv_lora_rank):
        raise ValueError(
            f"kv_b_proj_weight {tuple(kv_b_proj_weight.shape)} should be {(num_heads * per_head, m.kv_lora_rank)} for "
            f"{num_heads} heads"
        )
    if kv_b_proj_weight.dtype != q_nope.dtype:
        raise ValueError(f"kv_b_proj_weight dtype {kv_b_proj_weight.dtype} differs from q's {q_nope.dtype}")
    w = kv_b_proj_weight.reshape(num_heads, per_head, m.kv_lora_rank)
    w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]  # [H, nope, lora], [H, v, lora]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, lora], a view of [H, T, lora]
    out_latent = mla_latent_attention(
        q_latent, q_rope, kv_cache, inputs, scale, m.kv_lora_rank, decode_partition=decode_partition
    )
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous()  # [T, H, v]
