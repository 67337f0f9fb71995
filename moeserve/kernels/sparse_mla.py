"""DeepSeek Sparse Attention's two kernels over the paged caches: the lightning indexer's scores
(then top-k), and MLA over each query's chosen positions in the absorbed form.

`indexer_scores`: query t's score of the key at position s of its sequence is
`sum_h w[t, h] * relu(scale * q[t, h] . k[s])` for s <= t's position, -inf past it. One program
per (token, tile of keys): the token's `[Hi, Di]` queries against a tile of keys gathered from the
paged key cache, one tensor-core product, ReLU, then the weighted sum over heads.
`indexer_topk` takes each row's `index_topk` best with `torch.topk` (positions; -1 where a query
sees fewer keys than that). Below `index_topk` keys the caller attends densely instead.

`sparse_mla_attention`: per token, a tile of heads attends over the token's chosen positions
only, reading their latents from the paged latent cache by index (`softmax((q_latent . c +
q_rope . k_rope) * scale) . c`, online softmax over tiles of chosen positions; see
`mla_attention` for the absorption). `sparse_mla` wraps it with the absorption and un-absorption
through kv_b_proj: the result of `ops.sparse_mla.sparse_mla_attention`.

The torch reference (`ops.sparse_mla`) is what these are tested against (tests/kernels/
test_sparse_mla.py, under Triton's interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.config import MLAConfig
from moeserve.kernels.paged_attention import LOG2E, PagedInputs, cache_slots, dot_precision, online_softmax

SCORE_BLOCK_N = 64  # keys per indexer program
ATTEND_BLOCK_H = 16  # heads per sparse-attention program
ATTEND_BLOCK_N = 32  # chosen positions per tile: 32 latents of 512 bf16 are 32 KiB
SCORE_WARPS = 4
ATTEND_WARPS = 8  # a 16 x 512 fp32 accumulator beside a 32 x 512 latent tile, as `mla_attention`


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    out_ptr,
    block_table_ptr,
    token_seq_ptr,
    token_pos_ptr,
    scale,
    block_size,
    num_heads,
    num_keys,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_wt,
    stride_wh,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_ot,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(token_seq_ptr + tok)
    pos = tl.load(token_pos_ptr + tok)
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    dim_ok = dims < HEAD_DIM
    visible = keys <= pos
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    block, offset = cache_slots(block_table_ptr, seq, stride_bt, keys, visible, block_size)
    k = tl.load(
        cache_ptr + block[:, None] * stride_cb + offset[:, None] * stride_cs + dims[None, :] * stride_cd,
        mask=visible[:, None] & dim_ok[None, :],
        other=0.0,
    )
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale  # [BLOCK_H, BLOCK_N]
    w = tl.load(w_ptr + tok * stride_wt + heads * stride_wh, mask=head_ok, other=0.0)
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + tok * stride_ot + keys, score, mask=keys < num_keys)


@triton.jit
def _sparse_mla_kernel(
    q_lat_ptr,
    q_rope_ptr,
    cache_ptr,
    chosen_ptr,
    out_ptr,
    block_table_ptr,
    token_seq_ptr,
    token_pos_ptr,
    scale_log2,
    block_size,
    num_heads,
    topk,
    stride_qlt,
    stride_qlh,
    stride_qld,
    stride_qrt,
    stride_qrh,
    stride_qrd,
    stride_cb,
    stride_cs,
    stride_cd,
    stride_kt,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_LORA: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tok = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.load(token_seq_ptr + tok)
    pos = tl.load(token_pos_ptr + tok)
    head_ok = heads < num_heads
    lora = tl.arange(0, BLOCK_LORA)
    rope = tl.arange(0, BLOCK_ROPE)
    lora_ok = lora < LORA
    rope_ok = rope < ROPE
    q_lat = tl.load(
        q_lat_ptr + tok * stride_qlt + heads[:, None] * stride_qlh + lora[None, :] * stride_qld,
        mask=head_ok[:, None] & lora_ok[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + tok * stride_qrt + heads[:, None] * stride_qrh + rope[None, :] * stride_qrd,
        mask=head_ok[:, None] & rope_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_LORA], tl.float32)
    for start in range(0, topk, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        key_pos = tl.load(chosen_ptr + tok * stride_kt + idx, mask=idx < topk, other=-1)
        key_ok = (key_pos >= 0) & (key_pos <= pos)
        block, offset = cache_slots(block_table_ptr, seq, stride_bt, key_pos, key_ok, block_size)
        row = cache_ptr + block[:, None] * stride_cb + offset[:, None] * stride_cs
        c = tl.load(row + lora[None, :] * stride_cd, mask=key_ok[:, None] & lora_ok[None, :], other=0.0)
        k_rope = tl.load(row + (LORA + rope[None, :]) * stride_cd, mask=key_ok[:, None] & rope_ok[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c), input_precision=INPUT_PRECISION)
        s += tl.dot(q_rope, tl.trans(k_rope), input_precision=INPUT_PRECISION)
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        p, alpha, m_new, l_new = online_softmax(s, m_i, l_i)
        # A tile with no visible key (all -inf so far) leaves nothing: exp2(-inf - -inf) is NaN.
        has_any = m_new > float("-inf")
        p = tl.where(has_any[:, None], p, 0.0)
        alpha = tl.where(has_any, alpha, 1.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=INPUT_PRECISION)
        m_i = m_new
        l_i = tl.where(has_any, l_new, 0.0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tok * stride_ot + heads[:, None] * stride_oh + lora[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & lora_ok[None, :],
    )


def token_positions(inputs: PagedInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the step's tokens' sequence and position, `[T]` int32 each, on the device (no read
    back: the token count is the inputs' host int)."""
    device = inputs.context_lens.device
    query_lens = inputs.query_start[1:] - inputs.query_start[:-1]
    seq = torch.repeat_interleave(
        torch.arange(query_lens.shape[0], device=device), query_lens, output_size=inputs.num_tokens
    )
    first_pos = (inputs.context_lens - query_lens)[seq]
    pos = torch.arange(inputs.num_tokens, device=device) - inputs.query_start[seq] + first_pos
    return seq.to(torch.int32), pos.to(torch.int32)


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, inputs: PagedInputs
) -> torch.Tensor:
    """q `[T, Hi, Di]`, weights `[T, Hi]` float32 (scaled by Hi ** -0.5), key_cache `[num_blocks,
    block_size, Di]` -> scores `[T, max_context_len]` float32, -inf past each query's position."""
    seq, pos = token_positions(inputs)
    return paged_key_scores(
        q, weights, key_cache, inputs.block_table, seq, pos, inputs.max_context_len, inputs.block_size
    )


def paged_key_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq: torch.Tensor,
    last_key: torch.Tensor,
    num_keys: int,
    block_size: int,
) -> torch.Tensor:
    """The indexer's scores of token t over keys 0 .. `last_key[t]` of its sequence `seq[t]` (a
    row of `block_table [B, blocks]`; `seq`, `last_key` `[T]` int32) -> `[T, num_keys]` float32,
    -inf past `last_key[t]`. DSA's keys are positions (the last a query sees is its own);
    DeepSeek-V4's are compressed entries (the last closed at its position)."""
    num_tokens, num_heads, head_dim = q.shape
    if weights.shape != (num_tokens, num_heads) or key_cache.shape[2] != head_dim:
        raise ValueError(f"q {tuple(q.shape)}, weights {tuple(weights.shape)}, keys {tuple(key_cache.shape)} disagree")
    if q.dtype != key_cache.dtype:
        raise ValueError(f"q and the key cache must share a dtype, got {q.dtype}, {key_cache.dtype}")
    out = torch.empty(num_tokens, num_keys, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_keys == 0:
        return out
    _indexer_scores_kernel[(num_tokens, triton.cdiv(num_keys, SCORE_BLOCK_N))](
        q,
        weights,
        key_cache,
        out,
        block_table,
        seq,
        last_key,
        head_dim**-0.5,
        block_size,
        num_heads,
        num_keys,
        *q.stride(),
        *weights.stride(),
        *key_cache.stride(),
        out.stride(0),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=SCORE_BLOCK_N,
        INPUT_PRECISION=dot_precision(q.dtype),
        num_warps=SCORE_WARPS,
    )
    return out


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, inputs: PagedInputs, index_topk: int
) -> torch.Tensor:
    """Each query's `index_topk` best positions `[T, index_topk]` int32, -1 past what it sees.
    Needs `inputs.max_context_len > index_topk` (below, attend densely)."""
    if inputs.max_context_len <= index_topk:
        raise ValueError(
            f"contexts of at most {inputs.max_context_len} tokens attend densely (index_topk {index_topk})"
        )
    scores = indexer_scores(q, weights, key_cache, inputs)
    best = scores.topk(index_topk, dim=-1)
    return best.indices.masked_fill(best.values == float("-inf"), -1).to(torch.int32)


def sparse_mla_latent_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    chosen: torch.Tensor,
    inputs: PagedInputs,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """Latent attention of q_latent `[T, H, lora]` and q_rope `[T, H, rope]` over each token's
    `chosen [T, K]` positions (int32, -1: none) of kv_cache `[num_blocks, block_size, lora + rope]`
    -> out_latent `[T, H, lora]`."""
    num_tokens, num_heads, lora = q_latent.shape
    rope = q_rope.shape[2]
    if lora != kv_lora_rank or kv_cache.shape[2] != lora + rope or chosen.shape[0] != num_tokens:
        raise ValueError(
            f"q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, kv_cache {tuple(kv_cache.shape)}, "
            f"chosen {tuple(chosen.shape)} disagree with kv_lora_rank {kv_lora_rank}"
        )
    out = torch.empty(num_tokens, num_heads, lora, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0:
        return out
    seq, pos = token_positions(inputs)
    block_h = min(ATTEND_BLOCK_H, max(16, triton.next_power_of_2(num_heads)))
    _sparse_mla_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q_latent,
        q_rope,
        kv_cache,
        chosen,
        out,
        inputs.block_table,
        seq,
        pos,
        scale * LOG2E,
        inputs.block_size,
        num_heads,
        chosen.shape[1],
        *q_latent.stride(),
        *q_rope.stride(),
        *kv_cache.stride(),
        chosen.stride(0),
        *out.stride(),
        inputs.block_table.stride(0),
        LORA=lora,
        ROPE=rope,
        BLOCK_H=block_h,
        BLOCK_N=ATTEND_BLOCK_N,
        BLOCK_LORA=max(16, triton.next_power_of_2(lora)),
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        INPUT_PRECISION=dot_precision(q_latent.dtype),
        num_warps=ATTEND_WARPS,
    )
    return out


def sparse_mla(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_b_proj_weight: torch.Tensor,
    chosen: torch.Tensor,
    inputs: PagedInputs,
    scale: float,
    m: MLAConfig,
) -> torch.Tensor:
    """Sparse MLA absorbed through kv_b_proj (`[H * (nope + v), lora]`, this rank's heads): q_nope
    `[T, H, nope]`, q_rope `[T, H, rope]` rotated -> `[T, H, v_head_dim]` before o_proj."""
    num_heads = q_nope.shape[1]
    w = kv_b_proj_weight.reshape(num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, lora]
    out_latent = sparse_mla_latent_attention(q_latent, q_rope, kv_cache, chosen, inputs, scale, m.kv_lora_rank)
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous()
