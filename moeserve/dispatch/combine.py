"""The combine weighting every backend calls: one function, so their results are bit-equal.

Each token's output is the sum over its k experts of weight * expert output, accumulated in
ascending global expert id, the order of the HF reference loop (which adds expert after expert).
The sum is k explicit adds of `[T, H]` slices rather than a scatter-add, so it is the same on
every device (a CUDA index_add_ would accumulate in whatever order its atomics land).
"""

from __future__ import annotations

import torch


def weighted_sum(
    pair_rows: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    sum_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[T, H]`: per token, sum over k of `topk_weights[t, k] * pair_rows[t * K + k]`.

    pair_rows:     `[T * K, H]`, the expert output of each (token, k) pair, row `t * K + k`.
    topk_ids:      int64 `[T, K]` global expert ids, distinct per token: they fix the order of the sum.
    topk_weights:  float32 `[T, K]`, cast to pair_rows' dtype before the multiply.
    sum_order:     int64 `[T, K]` distinct per token, or None: the ids whose order fixes the sum's
                   order in place of topk_ids (`DispatchHandle.sum_order`).
    """
    num_tokens, top_k = topk_ids.shape
    hidden_size = pair_rows.shape[-1]
    order = topk_ids if sum_order is None else sum_order
    by_expert = order.argsort(dim=1)  # [T, K]: each token's k in ascending expert id
    rows = pair_rows.view(num_tokens, top_k, hidden_size).gather(1, by_expert[:, :, None].expand(-1, -1, hidden_size))
    weighted = rows * topk_weights.gather(1, by_expert).to(pair_rows.dtype)[:, :, None]
    out = pair_rows.new_zeros(num_tokens, hidden_size)
    for k in range(top_k):
        out += weighted[:, k]
    return out
