"""DeepSeek Sparse Attention in plain torch over the torch plan's buckets: the indexer's top-k per
query, and MLA over the chosen positions only, reading the paged latent cache by index. The
reference a kernel is held to, and the CPU path.

The definition (transformers' `DeepseekV32Indexer`): query t's score of an earlier key s is
`sum_h w[t, h] * relu(scale * q[t, h] . k[s])`, with `w = weights_proj(x) / sqrt(H)`, `scale =
index_head_dim ** -0.5`, over the keys t sees (causal); t attends to the `index_topk` best of them,
or to all of them when it sees no more than that. A bucket whose key length is at most
`index_topk` therefore attends densely, and skips the scoring: the same result (a decode bucket's
padded keys are masked either way).

FP8 keys (`DSAConfig.fp8_keys`): each key is cached as one row of bytes, its e4m3 values then a
float32 scale (`dispatch.fp8`'s per-token row: a single scale group up to 128 dims, so 132 bytes
at DeepSeek-V3.2's 128), and the scoring dequantizes the keys it gathers to float32.
"""

from __future__ import annotations

import torch

from moeserve.config import MLAConfig
from moeserve.dispatch import fp8
from moeserve.ops.attention import gather_from_cache
from moeserve.ops.torch_attention import (
    TorchAttentionPlan,
    bucket_attention,
    bucket_rows,
    expand_latents,
    step_order,
)

Selection = tuple[torch.Tensor | None, ...]
"""Per bucket of the plan, `[n, query_len, index_topk]` int64 positions in its keys, or None (dense)."""


def fp8_key_row_bytes(head_dim: int) -> int:
    """Bytes of one FP8 key row: `head_dim` e4m3 bytes (padded to 4) and a float32 scale per 128."""
    return fp8.packed_row_bytes(head_dim)


def fp8_key_rows(k: torch.Tensor) -> torch.Tensor:
    """Keys `[T, Di]` -> their cache rows, uint8 `[T, fp8_key_row_bytes(Di)]`."""
    return fp8.encode_rows(k).view(torch.uint8)


def keys_of_rows(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Cache rows uint8 `[N, fp8_key_row_bytes(Di)]` -> the keys they hold, float32 `[N, Di]`."""
    return fp8.decode_rows(rows.contiguous().view(torch.int32), head_dim).dequantize(torch.float32)


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, plan: TorchAttentionPlan, index_topk: int
) -> Selection:
    """q `[T, Hi, Di]` (rotated), weights `[T, Hi]` float32 (already scaled by Hi ** -0.5),
    key_cache `[num_blocks, block_size, Di]` holding this step's keys (uint8 `[.., .., row bytes]`:
    FP8 rows) -> each bucket's choice."""
    if all(b.key_len <= index_topk for b in plan.buckets):
        return (None,) * len(plan.buckets)
    keys = gather_from_cache(key_cache, plan.key_slots)  # [N, Di]
    if keys.dtype == torch.uint8:
        keys = keys_of_rows(keys, q.shape[-1])
    scale = q.shape[-1] ** -0.5
    chosen: list[torch.Tensor | None] = []
    for b, qb, wb in zip(plan.buckets, bucket_rows(q, plan), bucket_rows(weights, plan)):
        if b.key_len <= index_topk:
            chosen.append(None)
            continue
        kb = b.keys_of(keys).float()  # [n, K, Di]
        scores = torch.relu(torch.matmul(qb.float(), kb[:, None].transpose(-1, -2)) * scale)  # [n, Lq, Hi, K]
        index = torch.matmul(wb[:, :, None, :], scores)[:, :, 0] + b.bias[:, 0]  # [n, Lq, K]
        chosen.append(index.topk(index_topk, dim=-1).indices)
    return tuple(chosen)


def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: TorchAttentionPlan,
    kv_b_weight: torch.Tensor,
    mla: MLAConfig,
    scale: float,
    selection: Selection,
) -> torch.Tensor:
    """MLA (expanded, as `torch_attention.mla_attention`) where each query sees only its chosen
    keys: each of a bucket's `n * Lq` queries becomes a one-query sequence over its `index_topk`
    keys, gathered from the bucket's expanded keys and values; a chosen key the query may not see
    (it sees fewer than `index_topk`) stays masked. -> `[T, H, v_head_dim]`."""
    num_heads = q_nope.shape[1]
    if not plan.buckets:
        return q_nope.new_empty(0, num_heads, mla.v_head_dim)
    latents = gather_from_cache(kv_cache, plan.key_slots)
    weight = kv_b_weight.t()
    outs = []
    for b, qb, chosen in zip(plan.buckets, bucket_rows(torch.cat((q_nope, q_rope), dim=-1), plan), selection):
        k, v = expand_latents(b.keys_of(latents), weight, mla, num_heads)  # [n, K, H, D], [n, K, H, Dv]
        if chosen is None:
            outs.append(bucket_attention(qb, k, v, b.bias, scale))
            continue
        n, query_len, topk = chosen.shape
        seqs = torch.arange(n, device=chosen.device)[:, None]
        flat = chosen.reshape(n, query_len * topk)
        k_sel = k[seqs, flat].reshape(n * query_len, topk, num_heads, -1)
        v_sel = v[seqs, flat].reshape(n * query_len, topk, num_heads, -1)
        bias = b.bias[:, 0].gather(-1, chosen).reshape(n * query_len, 1, 1, topk)
        outs.append(bucket_attention(qb.reshape(n * query_len, 1, num_heads, -1), k_sel, v_sel, bias, scale))
    return step_order(outs, plan)
