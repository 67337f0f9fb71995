"""Paged attention kernels against the torch reference `ops.torch_attention.paged_attention`.

The reference is evaluated in fp32 on the very values given to the kernel (fp16 ones upcast):
the fp16 reference itself rounds scores and products to fp16 and is up to ~2.4e-3 off the exact
result on these shapes, while the kernel (fp32 scores and accumulation) stays under 1e-3, so
the 2e-3 fp16 tolerance is only meaningful against the exact answer.

Every step is built the way the engine builds one: block tables drawn at random from a larger
pool (so contexts are scattered over non-contiguous blocks), the pool filled with NaN and only
the context slots written, so a kernel that reads one slot it should not turns the result NaN.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import ATTENTION

from moeserve.kernels.paged_attention import PagedInputs, paged_attention, paged_inputs
from moeserve.ops.attention import attention_batch, write_to_cache
from moeserve.ops.torch_attention import TorchAttentionPlan, torch_attention_plan
from moeserve.ops.torch_attention import paged_attention as reference

SCALE = 0.3

# (start position, query length) per sequence. MIXED: a prompt from position 0, a chunk starting
# mid-sequence, a decode, and a long chunk that spans several query tiles and many blocks.
MIXED = [(0, 7), (5, 3), (13, 1), (30, 70)]
DECODE = [(0, 1), (3, 1), (17, 1), (40, 1), (90, 1)]
HEADS = [(4, 2, 16), (4, 1, 32), (2, 2, 16)]  # (Hq, Hkv, D): GQA, MQA, MHA


def make_step(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TorchAttentionPlan, PagedInputs]:
    """q, a NaN-filled K/V pool holding every sequence's context, and both forms of the plan."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(start + qlen) // block_size) for start, qlen in seqs]
    num_blocks = sum(needed) + 5
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(pool[used : used + n])
        used += n
    starts, qlens = [s for s, _ in seqs], [q for _, q in seqs]
    meta = torch_attention_plan(attention_batch(tables, starts, qlens, block_size, device))
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, dk), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full((num_blocks, block_size, num_kv_heads, dv), float("nan"), dtype=dtype, device=device)
    for slots in meta.context_slots:
        write_to_cache(k_cache, torch.randn(len(slots), num_kv_heads, dk, generator=gen).to(device), slots)
        write_to_cache(v_cache, torch.randn(len(slots), num_kv_heads, dv, generator=gen).to(device), slots)
    q = torch.randn(sum(qlens), num_heads, dk, generator=gen).to(device, dtype)
    return q, k_cache, v_cache, meta, paged_inputs(tables, starts, qlens, block_size, device)


def assert_matches_reference(seqs, block_size, heads, dtype, device, window=None, dv=None, **kwargs) -> None:
    num_heads, num_kv_heads, dk = heads
    q, k_cache, v_cache, meta, inputs = make_step(
        seqs, block_size, num_heads, num_kv_heads, dk, dv or dk, dtype, device
    )
    got = paged_attention(q, k_cache, v_cache, inputs, SCALE, window, **kwargs)
    want = reference(q.float(), k_cache.float(), v_cache.float(), meta, SCALE, window)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=ATTENTION[dtype], rtol=ATTENTION[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_and_mixed_batches_match_reference(dtype, heads, block_size, device):
    assert_matches_reference(MIXED, block_size, heads, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("partition", [16, 512])  # 16: up to 6 partitions per sequence, merged
def test_decode_batches_match_reference(dtype, heads, partition, device):
    assert_matches_reference(DECODE, 4, heads, dtype, device, decode_partition=partition)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seqs, partition", [(MIXED, 512), (DECODE, 16), (DECODE, 512)])
def test_sliding_window_matches_reference(dtype, seqs, partition, device):
    assert_matches_reference(seqs, 4, (4, 2, 16), dtype, device, window=9, decode_partition=partition)


def test_value_head_dim_may_differ_from_key_head_dim(device):
    assert_matches_reference(MIXED, 16, (4, 2, 16), torch.float32, device, dv=32)
    assert_matches_reference(DECODE, 16, (4, 2, 16), torch.float32, device, dv=32, decode_partition=16)


def test_kv_halves_of_one_cache_and_strided_q(device):
    """The layer passes `kv_cache[0]`, `kv_cache[1]` of a `[2, ...]` cache and q may be a slice."""
    q, k_cache, v_cache, meta, inputs = make_step(MIXED, 4, 4, 2, 16, 16, torch.float32, device)
    kv = torch.stack((k_cache, v_cache))
    wide = torch.cat((q, torch.zeros_like(q)), dim=-1)[..., :16]
    got = paged_attention(wide, kv[0], kv[1], inputs, SCALE)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta, SCALE), atol=1e-5, rtol=1e-5)


def test_decode_result_does_not_depend_on_the_batch(device):
    """Split-KV partitions are fixed in size, so a sequence's bits are its own."""
    q, k_cache, v_cache, _, inputs = make_step(DECODE, 4, 4, 2, 16, 16, torch.float32, device)
    batched = paged_attention(q, k_cache, v_cache, inputs, SCALE, decode_partition=16)
    table = inputs.block_table[4].tolist()
    alone = paged_attention(
        q[4:5], k_cache, v_cache, paged_inputs([table], [90], [1], 4, device), SCALE, decode_partition=16
    )
    assert torch.equal(alone, batched[4:5])


def test_paged_inputs_layout():
    inputs = paged_inputs([[7, 2, 9], [4]], [9, 0], [2, 1], 4, "cpu")
    assert inputs.block_table.tolist() == [[7, 2, 9], [4, 0, 0]]
    assert inputs.block_table.dtype == inputs.context_lens.dtype == inputs.query_start.dtype == torch.int32
    assert inputs.context_lens.tolist() == [11, 1]
    assert inputs.query_start.tolist() == [0, 2, 3]
    assert (inputs.max_query_len, inputs.max_context_len, inputs.num_tokens, inputs.block_size) == (2, 11, 3, 4)


def test_empty_step(device):
    inputs = paged_inputs([], [], [], 4, device)
    cache = torch.zeros(2, 4, 1, 16, device=device)
    assert paged_attention(torch.zeros(0, 2, 16, device=device), cache, cache, inputs, SCALE).shape == (0, 2, 16)


@pytest.mark.parametrize(
    "tables, starts, qlens, match",
    [
        ([[0]], [0], [0], "query_len must be >= 1"),
        ([[0]], [2], [3], "positions up to 5 need 2"),
        ([[0], [1]], [0], [1, 1], "differ in length"),
    ],
)
def test_paged_inputs_rejects_bad_steps(tables, starts, qlens, match):
    with pytest.raises(ValueError, match=match):
        paged_inputs(tables, starts, qlens, 4, "cpu")


def test_paged_attention_rejects_bad_inputs(device):
    inputs = paged_inputs([[0, 1]], [0], [5], 4, device)
    cache = torch.zeros(3, 4, 2, 16, device=device)
    q = torch.zeros(5, 4, 16, device=device)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(torch.zeros(5, 3, 16, device=device), cache, cache, inputs, SCALE)
    with pytest.raises(ValueError, match="head dim"):
        paged_attention(torch.zeros(5, 4, 8, device=device), cache, cache, inputs, SCALE)
    with pytest.raises(ValueError, match="share a dtype"):
        paged_attention(q.half(), cache, cache, inputs, SCALE)
    with pytest.raises(ValueError, match="add up to 5"):
        paged_attention(q[:4], cache, cache, inputs, SCALE)
    with pytest.raises(ValueError, match="block size"):
        paged_attention(
            q, torch.zeros(3, 8, 2, 16, device=device), torch.zeros(3, 8, 2, 16, device=device), inputs, SCALE
        )
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, cache, cache, inputs, SCALE, sliding_window=0)


# ---------------------------------------------------------------------------------------------
# Real shapes in bf16 (Qwen3-30B-A3B attention: 32 query heads, 4 KV heads, head dim 128).
# bf16 is judged against an fp32 reference: the kernel must be no less accurate than the torch
# bf16 reference is (the kernel keeps scores in fp32, the reference rounds them to bf16).
# ---------------------------------------------------------------------------------------------


def assert_as_accurate_as_bf16_reference(seqs, window, device, **kwargs) -> None:
    q, k_cache, v_cache, meta, inputs = make_step(seqs, 16, 32, 4, 128, 128, torch.bfloat16, device, seed=1)
    got = paged_attention(q, k_cache, v_cache, inputs, 128**-0.5, window, **kwargs).float()
    truth = reference(q.float(), k_cache.float(), v_cache.float(), meta, 128**-0.5, window)
    bf16_error = (reference(q, k_cache, v_cache, meta, 128**-0.5, window).float() - truth).abs().max().item()
    assert (got - truth).abs().max().item() <= 2 * bf16_error + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_bf16_decode_batch_of_64(window, device):
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(1, 4097, (64,), generator=gen).tolist()
    assert_as_accurate_as_bf16_reference([(c - 1, 1) for c in contexts], window, device)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_bf16_prefill_chunks_and_decodes(window, device):
    seqs = [(0, 2048), (1500, 512), (4000, 96), (3000, 1), (17, 1), (0, 1)]
    assert_as_accurate_as_bf16_reference(seqs, window, device)


@pytest.mark.gpu
def test_gpu_fp32_matches_reference(device):
    """fp32 must use IEEE products, not TF32, to stay this close."""
    q, k_cache, v_cache, meta, inputs = make_step(
        [(0, 300), (700, 1), (90, 40)], 16, 32, 4, 128, 128, torch.float32, device
    )
    got = paged_attention(q, k_cache, v_cache, inputs, 128**-0.5)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, meta, 128**-0.5), atol=2e-5, rtol=2e-5)
