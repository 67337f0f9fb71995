"""DeepSeek Sparse Attention's Triton kernels against the torch reference (`ops.sparse_mla`).

One step mixing a prompt from position 0 (its first queries see fewer keys than the top-k), a
mid-sequence chunk and decodes of short and long contexts, over block tables scattered in a larger
pool: the indexer's top-k positions are the reference's, and sparse MLA over the reference's
choice gives the reference's output (fp32, the interpreter on CPU).
"""

from __future__ import annotations

import torch

from moeserve.config import MLAConfig
from moeserve.kernels.paged_attention import paged_inputs
from moeserve.kernels.sparse_mla import indexer_topk, sparse_mla
from moeserve.ops import sparse_mla as reference
from moeserve.ops.attention import attention_batch
from moeserve.ops.torch_attention import bucket_rows, step_order, torch_attention_plan

STEP = [(0, 20), (11, 6), (4, 1), (37, 1), (70, 1)]  # (start, query length)
TOPK, BLOCK_SIZE = 8, 4
MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
HEADS, INDEX_HEADS, INDEX_DIM = 4, 16, 16


def step(gen: torch.Generator):
    needed = [-(-(start + qlen) // BLOCK_SIZE) for start, qlen in STEP]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [pool[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(STEP))]
    starts, qlens = [s for s, _ in STEP], [q for _, q in STEP]
    plan = torch_attention_plan(attention_batch(tables, starts, qlens, BLOCK_SIZE))
    return num_blocks, plan, paged_inputs(tables, starts, qlens, BLOCK_SIZE, "cpu")


def per_token(selection, plan) -> torch.Tensor:
    """The reference's per-bucket choice as `[T, TOPK]` positions, -1 where the key is hidden."""
    rows = []
    for b, chosen in zip(plan.buckets, selection):
        seen = b.bias[:, 0].gather(-1, chosen) == 0
        rows.append(torch.where(seen, chosen, -1).flatten(0, 1))
    return step_order(rows, plan)


def test_indexer_topk_and_sparse_attention_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    num_blocks, plan, inputs = step(gen)
    tokens = inputs.num_tokens
    q = torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen)
    weights = torch.randn(tokens, INDEX_HEADS, generator=gen) * INDEX_HEADS**-0.5
    keys = torch.randn(num_blocks, BLOCK_SIZE, INDEX_DIM, generator=gen)
    expected = reference.indexer_topk(q, weights, keys, plan, TOPK)
    assert all(chosen is not None for chosen in expected)
    want = per_token(expected, plan)
    got = indexer_topk(q, weights, keys, inputs, TOPK)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values.int())
    assert (got == -1).any() and (got >= 0).all(-1).any()  # some queries see fewer than TOPK keys, some more

    latents = torch.randn(num_blocks, BLOCK_SIZE, MLA.kv_lora_rank + MLA.qk_rope_head_dim, generator=gen)
    kv_b = torch.randn(HEADS * (MLA.qk_nope_head_dim + MLA.v_head_dim), MLA.kv_lora_rank, generator=gen) * 0.3
    q_nope = torch.randn(tokens, HEADS, MLA.qk_nope_head_dim, generator=gen)
    q_rope = torch.randn(tokens, HEADS, MLA.qk_rope_head_dim, generator=gen)
    scale = MLA.qk_head_dim**-0.5
    ref = reference.sparse_mla_attention(q_nope, q_rope, latents, plan, kv_b, MLA, scale, expected)
    out = sparse_mla(q_nope, q_rope, latents, kv_b, want.int(), inputs, scale, MLA)
    assert (out - ref).abs().max().item() < 1e-4
    dense = reference.sparse_mla_attention(q_nope, q_rope, latents, plan, kv_b, MLA, scale, (None,) * len(expected))
    assert (dense - ref).abs().max().item() > 1e-2  # the choice matters here


def test_bucket_rows_round_trip_to_the_step_order():
    """`per_token` above relies on it: bucket rows then `step_order` give the tokens back."""
    _, plan, inputs = step(torch.Generator().manual_seed(1))
    x = torch.arange(inputs.num_tokens)
    assert torch.equal(step_order([r.flatten(0, 1) for r in bucket_rows(x, plan)], plan), x)
