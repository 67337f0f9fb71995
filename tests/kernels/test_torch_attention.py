"""The torch backend's one-pass attention against its per-sequence definition, and its batch
invariance: a sequence's output bits do not depend on the rest of the step.

Steps are built as the engine builds them: block tables scattered over a larger pool filled
with NaN, only the context slots written, so reading any other slot (padding included) shows.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.config import MLAConfig
from moeserve.ops.attention import attention_batch, gather_from_cache, write_to_cache
from moeserve.ops.torch_attention import (
    MIN_PADDED_CONTEXT,
    TorchAttentionPlan,
    causal_attention,
    mla_attention,
    padded_context_len,
    paged_attention,
    torch_attention_plan,
)

SCALE = 0.3
BLOCK = 4
# (start, query length): three decodes sharing a bucket (the last one out of step order), decodes
# in other buckets, a prompt, a chunk in the middle of a sequence, a prompt under the smallest bucket.
STEP = [(60, 1), (61, 1), (13, 1), (200, 1), (0, 40), (90, 17), (0, 3), (299, 1), (50, 1)]
MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def make_plan(seqs, gen: torch.Generator) -> tuple[int, list[list[int]], TorchAttentionPlan]:
    needed = [-(-(start + qlen) // BLOCK) for start, qlen in seqs]
    num_blocks = sum(needed) + 5
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    bounds = [0, *torch.tensor(needed).cumsum(0).tolist()]
    tables = [pool[a:b] for a, b in zip(bounds, bounds[1:])]
    return num_blocks, tables, plan_for(seqs, tables)


def plan_for(seqs, tables) -> TorchAttentionPlan:
    return torch_attention_plan(attention_batch(tables, [s for s, _ in seqs], [q for _, q in seqs], BLOCK))


def filled_cache(shape: tuple[int, ...], plan: TorchAttentionPlan, gen: torch.Generator, dtype) -> torch.Tensor:
    cache = torch.full(shape, float("nan"), dtype=dtype)
    for slots in plan.context_slots:
        write_to_cache(cache, torch.randn(len(slots), *shape[2:], generator=gen).to(dtype), slots)
    return cache


def token_spans(seqs) -> list[slice]:
    bounds = [0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def test_padded_length_is_the_sequences_own_and_bounded():
    assert padded_context_len(1) == padded_context_len(MIN_PADDED_CONTEXT) == MIN_PADDED_CONTEXT
    for n in range(1, 5000):
        padded = padded_context_len(n)
        assert n <= padded and (n <= MIN_PADDED_CONTEXT or padded < 1.5 * n), n
        assert padded_context_len(padded) == padded  # a bucket length is its own bucket
    assert len({padded_context_len(n) for n in range(64, 301)}) <= 6  # few calls for a decode step


def test_plan_lists_every_context_and_reorders_rows_only_when_needed():
    gen = torch.Generator().manual_seed(0)
    _, tables, plan = make_plan(STEP, gen)
    for (start, qlen), table, slots in zip(STEP, tables, plan.context_slots):
        positions = torch.arange(start + qlen)
        assert torch.equal(slots, torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK)
    assert sorted(plan.query_rows.tolist()) == list(range(sum(q for _, q in STEP)))
    # Decodes padded on the grid, three of them in one bucket; chunks at their exact length.
    shapes = {(b.num_seqs, b.query_len, b.key_len) for b in plan.buckets}
    assert shapes == {(3, 1, 64), (1, 1, 32), (1, 1, 256), (1, 1, 384), (1, 40, 40), (1, 17, 107), (1, 3, 3)}
    decodes = plan_for([(60, 1), (61, 1), (62, 1)], [list(range(16))] * 3)
    assert decodes.query_rows is None and len(decodes.buckets) == 1
    with pytest.raises(ValueError, match="query_len >= 1"):
        plan_for([(3, 0)], [[0]])


@pytest.mark.parametrize("heads", [(4, 2, 16), (4, 1, 32), (2, 2, 16)])  # GQA, MQA, MHA
@pytest.mark.parametrize("window", [None, 9])
def test_paged_attention_is_the_per_sequence_definition(heads, window):
    num_heads, num_kv_heads, dim = heads
    gen = torch.Generator().manual_seed(1)
    num_blocks, _, plan = make_plan(STEP, gen)
    k_cache = filled_cache((num_blocks, BLOCK, num_kv_heads, dim), plan, gen, torch.float32)
    v_cache = filled_cache((num_blocks, BLOCK, num_kv_heads, dim), plan, gen, torch.float32)
    q = torch.randn(sum(q for _, q in STEP), num_heads, dim, generator=gen)
    got = paged_attention(q, k_cache, v_cache, plan, SCALE, window)
    for span, slots in zip(token_spans(STEP), plan.context_slots):
        k, v = gather_from_cache(k_cache, slots), gather_from_cache(v_cache, slots)
        torch.testing.assert_close(got[span], causal_attention(q[span], k, v, SCALE, window), atol=1e-5, rtol=1e-5)


def mla_inputs(seqs, gen, dtype):
    num_blocks, tables, plan = make_plan(seqs, gen)
    cache = filled_cache((num_blocks, BLOCK, MLA.kv_lora_rank + MLA.qk_rope_head_dim), plan, gen, dtype)
    weight = (torch.randn(4 * (MLA.qk_nope_head_dim + MLA.v_head_dim), MLA.kv_lora_rank, generator=gen) / 4).to(dtype)
    num_tokens = sum(q for _, q in seqs)
    q_nope = torch.randn(num_tokens, 4, MLA.qk_nope_head_dim, generator=gen).to(dtype)
    q_rope = torch.randn(num_tokens, 4, MLA.qk_rope_head_dim, generator=gen).to(dtype)
    return tables, plan, cache, weight, q_nope, q_rope


def test_mla_attention_is_the_expanded_definition():
    gen = torch.Generator().manual_seed(2)
    _, plan, cache, weight, q_nope, q_rope = mla_inputs(STEP, gen, torch.float32)
    got = mla_attention(q_nope, q_rope, cache, plan, weight, MLA, SCALE)
    assert got.shape == (len(q_nope), 4, MLA.v_head_dim)
    for span, slots in zip(token_spans(STEP), plan.context_slots):
        latent, k_rope = gather_from_cache(cache, slots).split([MLA.kv_lora_rank, MLA.qk_rope_head_dim], dim=-1)
        k_nope, v = (latent @ weight.T).view(len(slots), 4, -1).split([MLA.qk_nope_head_dim, MLA.v_head_dim], -1)
        k = torch.cat((k_nope, k_rope[:, None].expand(-1, 4, -1)), dim=-1)
        q = torch.cat((q_nope[span], q_rope[span]), dim=-1)
        torch.testing.assert_close(got[span], causal_attention(q, k, v, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 9])
def test_paged_output_bits_do_not_depend_on_the_batch(dtype, window):
    gen = torch.Generator().manual_seed(3)
    num_blocks, tables, plan = make_plan(STEP, gen)
    k_cache = filled_cache((num_blocks, BLOCK, 2, 16), plan, gen, dtype)
    v_cache = filled_cache((num_blocks, BLOCK, 2, 16), plan, gen, dtype)
    q = torch.randn(sum(q for _, q in STEP), 4, 16, generator=gen).to(dtype)
    batched = paged_attention(q, k_cache, v_cache, plan, SCALE, window)
    for seq, span, table in zip(STEP, token_spans(STEP), tables):
        alone = paged_attention(q[span], k_cache, v_cache, plan_for([seq], [table]), SCALE, window)
        assert torch.equal(alone, batched[span]), seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_output_bits_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(4)
    tables, plan, cache, weight, q_nope, q_rope = mla_inputs(STEP, gen, dtype)
    batched = mla_attention(q_nope, q_rope, cache, plan, weight, MLA, SCALE)
    for seq, span, table in zip(STEP, token_spans(STEP), tables):
        alone = mla_attention(q_nope[span], q_rope[span], cache, plan_for([seq], [table]), weight, MLA, SCALE)
        assert torch.equal(alone, batched[span]), seq


def test_empty_step():
    plan = plan_for([], [])
    cache = torch.zeros(2, BLOCK, 1, 16)
    assert paged_attention(torch.zeros(0, 2, 16), cache, cache, plan, SCALE).shape == (0, 2, 16)
    latent = torch.zeros(2, BLOCK, MLA.kv_lora_rank + MLA.qk_rope_head_dim)
    weight = torch.zeros(2 * (MLA.qk_nope_head_dim + MLA.v_head_dim), MLA.kv_lora_rank)
    out = mla_attention(torch.zeros(0, 2, 16), torch.zeros(0, 2, 8), latent, plan, weight, MLA, SCALE)
    assert out.shape == (0, 2, MLA.v_head_dim)
