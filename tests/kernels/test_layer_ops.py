"""The `LayerOps` backends against the torch reference, through the interface layers use: attention
plans, the fused residual add + RMSNorm and the q/k rotation. Triton runs under its interpreter
on CPU (see conftest.py), natively on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.tolerances import ATTENTION, ELEMENTWISE

from moeserve.ops import TORCH_OPS, LayerOps, attention_batch
from moeserve.ops.attention import write_to_cache
from moeserve.ops.rotary import apply_rotary
from moeserve.ops.torch_attention import TorchAttentionPlan
from moeserve.ops.triton_ops import TritonAttentionPlan, TritonOps

BACKENDS = [TORCH_OPS, TritonOps()]
IDS = [ops.name for ops in BACKENDS]
EPS = 1e-6


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor a plan holds, however nested in dataclasses and tuples."""
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        return [t for field in dataclasses.fields(value) for t in tensors_in(getattr(value, field.name))]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    return []


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def test_attention_batch_slots_are_the_new_tokens_slots():
    batch = attention_batch([[7, 2, 9], [4]], [9, 0], [2, 1], 4)
    assert batch.slot_mapping.tolist() == [9 * 4 + 1, 9 * 4 + 2, 4 * 4]  # positions 9, 10 -> block 9; 0 -> block 4
    assert batch.slot_mapping.dtype == torch.int64
    assert batch.context_lens == (11, 1)
    assert attention_batch([], [], [], 4).slot_mapping.shape == (0,)


@pytest.mark.parametrize(
    "tables, starts, qlens, match",
    [([[0]], [2], [3], "positions up to 5 need 2"), ([[0], [1]], [0], [1, 1], "differ in length")],
)
def test_attention_batch_rejects_bad_steps(tables, starts, qlens, match):
    with pytest.raises(ValueError, match=match):
        attention_batch(tables, starts, qlens, 4)


def test_triton_plan_holds_no_per_sequence_slots(device):
    """Two sequences 4000 tokens deep, decoding: the torch reference's plan lists every context
    slot, the Triton plan only block tables (1 entry per 16 tokens) and per-sequence lengths."""
    tables = [list(range(250)), list(range(250, 500))]
    batch = attention_batch(tables, [3999, 3999], [1, 1], 16, device)
    plan = TritonOps().plan_attention(batch)
    assert isinstance(plan, TritonAttentionPlan) and plan.slot_mapping is batch.slot_mapping
    assert sum(t.numel() for t in tensors_in(plan)) <= 2 * 250 + 16
    torch_plan = TORCH_OPS.plan_attention(batch)
    assert isinstance(torch_plan, TorchAttentionPlan)
    assert [len(slots) for slots in torch_plan.context_slots] == [4000, 4000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ops", BACKENDS, ids=IDS)
def test_paged_attention_through_each_backends_plan(ops: LayerOps, dtype, device):
    """A mixed step (prompt, mid-sequence chunk, decode) planned by the backend itself."""
    gen = torch.Generator().manual_seed(0)
    seqs, block_size, heads, kv_heads, dim = [(0, 7), (5, 3), (13, 1)], 4, 4, 2, 16
    tables, first = [], 0
    for start, qlen in seqs:  # reversed block ids: the context is not contiguous in the pool
        n = -(-(start + qlen) // block_size)
        tables.append(list(range(first + n - 1, first - 1, -1)))
        first += n
    batch = attention_batch(tables, [s for s, _ in seqs], [q for _, q in seqs], block_size, device)
    k_cache = torch.zeros(first, block_size, kv_heads, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    context = attention_batch(tables, [0] * len(seqs), [s + q for s, q in seqs], block_size, device).slot_mapping
    write_to_cache(k_cache, randn((len(context), kv_heads, dim), dtype, device, gen), context)
    write_to_cache(v_cache, randn((len(context), kv_heads, dim), dtype, device, gen), context)
    q = randn((batch.slot_mapping.shape[0], heads, dim), dtype, device, gen)

    got = ops.paged_attention(q, k_cache, v_cache, ops.plan_attention(batch), 0.3, None)
    reference_plan = TORCH_OPS.plan_attention(batch)
    want = TORCH_OPS.paged_attention(q.float(), k_cache.float(), v_cache.float(), reference_plan, 0.3, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=ATTENTION[dtype], rtol=ATTENTION[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [0, 5])
@pytest.mark.parametrize("ops", BACKENDS, ids=IDS)
def test_add_rms_norm_is_the_add_then_the_norm(ops: LayerOps, dtype, tokens, device):
    gen = torch.Generator().manual_seed(tokens)
    x, residual = randn((tokens, 64), dtype, device, gen), randn((tokens, 64), dtype, device, gen)
    weight = (1 + 0.5 * randn((64,), torch.float32, device, gen)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    normed, h = ops.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(h, x + residual)  # the residual stream is exactly torch's add
    expected = TORCH_OPS.rms_norm(x + residual, weight, EPS)
    if ops is TORCH_OPS:  # the layers' reference path: bit for bit what the unfused layers computed
        assert torch.equal(normed, expected)
    torch.testing.assert_close(normed, expected, atol=ELEMENTWISE[dtype], rtol=ELEMENTWISE[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("ops", BACKENDS, ids=IDS)
def test_rotary_qk_rotates_both(ops: LayerOps, dtype, interleaved, device):
    """GQA shapes (4 query heads, 2 key heads), as `Attention` rotates them."""
    gen = torch.Generator().manual_seed(2)
    q, k = randn((7, 4, 16), dtype, device, gen), randn((7, 2, 16), dtype, device, gen)
    cos, sin = randn((7, 16), dtype, device, gen), randn((7, 16), dtype, device, gen)
    q_expected, k_expected = apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)
    q_got, k_got = ops.rotary_qk(q, k, cos, sin, interleaved)
    for got, want in ((q_got, q_expected), (k_got, k_expected)):
        torch.testing.assert_close(got, want, atol=ELEMENTWISE[dtype], rtol=ELEMENTWISE[dtype])
        if dtype == torch.float16:  # each product and sum rounded where torch rounds it
            assert torch.equal(got, want)


@pytest.mark.parametrize("ops", BACKENDS, ids=IDS)
def test_rotary_qk_on_mla_views(ops: LayerOps, device):
    """MLA rotates views: the rope part of each query head and the shared rope key inside
    kv_a_proj's output. What comes back is rotated; the nope and latent parts are untouched."""
    gen = torch.Generator().manual_seed(3)
    q, kv = randn((5, 3, 24 + 8), torch.float32, device, gen), randn((5, 20 + 8), torch.float32, device, gen)
    cos, sin = randn((5, 8), torch.float32, device, gen), randn((5, 8), torch.float32, device, gen)
    q_nope_before, latent_before = q[..., :24].clone(), kv[:, :20].clone()
    q_expected = apply_rotary(q[..., 24:], cos, sin, True)
    k_expected = apply_rotary(kv[:, None, 20:], cos, sin, True)
    q_rope, k_rope = ops.rotary_qk(q[..., 24:], kv[:, None, 20:], cos, sin, True)
    torch.testing.assert_close(q_rope, q_expected, atol=ELEMENTWISE[torch.float32], rtol=ELEMENTWISE[torch.float32])
    torch.testing.assert_close(k_rope, k_expected, atol=ELEMENTWISE[torch.float32], rtol=ELEMENTWISE[torch.float32])
    assert torch.equal(q[..., :24], q_nope_before) and torch.equal(kv[:, :20], latent_before)
