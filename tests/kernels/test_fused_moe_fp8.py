"""The fused MoE with block-scaled FP8 experts (w8a8) against its torch reference.

The reference quantizes the rows per token group exactly as the kernel does (bit for bit, see
test_fp8_quant.py), dequantizes, and runs fp32 matmuls per expert; the activation between the
GEMMs is rounded to hidden's dtype and quantized again, as the kernels store it. In fp32 the two
differ in summation order only (about 1e-7 relative), unless that difference moves an activation
across an e4m3 rounding boundary, which would cost ~1e-3 of the output: the fixed seeds here show
none, and 1e-5 of the largest output tells the two cases apart. fp16 adds its own rounding.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.config import GatedActivation
from moeserve.dispatch.base import DispatchLayout
from moeserve.dispatch.fp8 import local_rows
from moeserve.fp8_format import BlockFP8Weight, quantize
from moeserve.kernels import fused_moe_fp8
from moeserve.kernels.fused_moe_fp8 import fused_moe_w8a8, fused_moe_w8a8_reference
from moeserve.kernels.launch_config import block_m_for
from moeserve.kernels.moe_align import moe_align_block_size
from moeserve.ops import triton_ops
from moeserve.ops.grouped_mlp import row_experts
from moeserve.ops.triton_ops import TritonOps

# Past one 128 block: two K tiles (one partial) in both GEMMs, gate and up meeting inside a block.
H, I, E, K = 192, 160, 4, 2
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def fp8_experts(num_experts: int, parts: int, rows: int, cols: int, device, seed: int) -> BlockFP8Weight:
    """Stacked experts of `parts` checkpoint tensors `[rows, cols]` each, each with its own grid."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    data, scales = [], []
    for e in range(num_experts):
        tiles = [quantize(torch.randn(rows, cols, generator=g) * (e + 1) / cols**0.5, (128, 128)) for _ in range(parts)]
        data.append(torch.cat([q for q, _ in tiles]))
        scales.append(torch.stack([s for _, s in tiles]))
    return BlockFP8Weight(torch.stack(data).to(device), torch.stack(scales).to(device), (128, 128))


def moe_inputs(num_tokens: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(num_tokens, H, generator=g).to(dtype).to(device)
    topk_ids = torch.rand(num_tokens, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    return hidden, topk_ids, torch.rand(num_tokens * K, generator=g).to(device)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.numel():
        bound = TOL[want.dtype] * want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= bound


@pytest.fixture(scope="module")
def weights(device):
    return fp8_experts(E, 2, I, H, device, seed=1), fp8_experts(E, 1, H, I, device, seed=2)


@pytest.mark.parametrize(
    "num_tokens,dtype,weighted",
    [
        (0, torch.float32, False),
        (5, torch.float32, True),
        (33, torch.float32, False),
        (7, torch.float16, True),
        # 70 and 260 pairs per expert: the 64- and 128-row tiles, at w8a8's half-width columns
        (140, torch.float32, False),
        (520, torch.float32, True),
    ],
)
def test_matches_reference(device, weights, num_tokens, dtype, weighted):
    w13, w2 = weights
    hidden, topk_ids, pair_weights = moe_inputs(num_tokens, dtype, device)
    aligned = moe_align_block_size(topk_ids, E, block_m_for(num_tokens, K, E))
    args = (hidden, w13, w2, aligned, K, pair_weights if weighted else None)
    got = fused_moe_w8a8(*args)
    assert got.shape == (num_tokens * K, H) and got.dtype == dtype
    assert_close(got, fused_moe_w8a8_reference(*args))


def test_clamped_silu_matches_reference(device, weights):
    """DeepSeek-V4's clamped SiLU in the w8a8 kernel's epilogue (the clamp at 1 bites: the plain
    SiLU kernel's result differs)."""
    w13, w2 = weights
    hidden, topk_ids, pair_weights = moe_inputs(5, torch.float32, device, seed=3)
    aligned = moe_align_block_size(topk_ids, E, block_m_for(5, K, E))
    args = (hidden, w13, w2, aligned, K, pair_weights)
    clamped = GatedActivation("clamped_silu", limit=1.0)
    got = fused_moe_w8a8(*args, activation=clamped)
    assert_close(got, fused_moe_w8a8_reference(*args, activation=clamped))
    assert (got - fused_moe_w8a8(*args)).abs().max().item() > 1e-2 * got.abs().max().item()


def test_expert_major_rows_with_padding(device, weights):
    """After an EP dispatch (EXPERT_MAJOR, as TritonOps.experts aligns it): rows grouped by
    expert, one expert empty, top_k = 1; padding rows (expert id E) come out as zeros."""
    w13, w2 = weights
    counts = torch.tensor([3, 0, 6, 2], device=device)
    rows = torch.randn(14, H, device=device)  # 11 real rows, then 3 of padding
    topk_ids = row_experts(counts, rows.shape[0])[:, None].to(torch.int32)
    aligned = moe_align_block_size(topk_ids, E, block_m_for(rows.shape[0], 1, E))
    got = fused_moe_w8a8(rows, w13, w2, aligned, 1)
    assert_close(got, fused_moe_w8a8_reference(rows, w13, w2, aligned, 1))
    assert torch.equal(got[11:], torch.zeros_like(got[11:])) and got[:11].abs().amax(dim=1).min() > 0


def test_rows_an_fp8_dispatch_delivered_are_taken_as_they_are(device, weights, monkeypatch):
    """Given the dispatch's FP8 rows (`DispatchOutput.fp8_rows`: 128-channel groups, as the
    weights' K block), the kernel computes on those bytes and scales and quantizes nothing of
    its input; the result is the reference's on the same rows."""
    w13, w2 = weights
    x, topk_ids, pair_weights = moe_inputs(9, torch.float32, device)
    rows = local_rows(x)
    hidden = rows.dequantize(torch.float32)
    aligned = moe_align_block_size(topk_ids, E, block_m_for(9, K, E))

    def no_input_quantization(*args, **kwargs):
        raise AssertionError("the rows were quantized again")

    monkeypatch.setattr(fused_moe_fp8, "per_token_group_quant", no_input_quantization)
    got = fused_moe_w8a8(hidden, w13, w2, aligned, K, pair_weights, hidden_fp8=(rows.q, rows.scales))
    want = fused_moe_w8a8_reference(hidden, w13, w2, aligned, K, pair_weights, hidden_fp8=(rows.q, rows.scales))
    assert_close(got, want)
    with pytest.raises(ValueError, match="hidden_fp8 must be"):
        fused_moe_w8a8(hidden, w13, w2, aligned, K, hidden_fp8=(rows.q, rows.scales[:, :1]))


def test_triton_experts_hand_the_kernel_dispatched_rows_of_its_block(device, weights, monkeypatch):
    """TritonOps.experts passes an FP8 dispatch's rows on when their groups are the weights' K
    blocks (128), and quantizes x itself when they are not."""
    w13, w2 = weights
    x, topk_ids, _ = moe_inputs(4, torch.float32, device)
    rows = local_rows(x)
    seen = []
    monkeypatch.setattr(triton_ops, "fused_moe_w8a8", lambda *args, **kwargs: seen.append(kwargs["hidden_fp8"]))
    ops, counts = TritonOps(), torch.zeros(E, dtype=torch.int64, device=device)
    ops.experts(rows.dequantize(x.dtype), DispatchLayout.TOKEN_MAJOR, counts, topk_ids.long(), w13, w2, x_fp8=rows)
    other_block = BlockFP8Weight(w13.data, w13.scale_inv.repeat_interleave(2, dim=-1)[..., :3], (128, 64))
    ops.experts(x, DispatchLayout.TOKEN_MAJOR, counts, topk_ids.long(), other_block, w2, x_fp8=rows)
    assert seen[0][0] is rows.q and seen[0][1] is rows.scales and seen[1] is None


def test_bad_weights_are_refused(device, weights):
    w13, w2 = weights
    hidden, topk_ids, _ = moe_inputs(3, torch.float32, device)
    aligned = moe_align_block_size(topk_ids, E, block_m_for(3, K, E))
    w2_other_block = BlockFP8Weight(w2.data, w2.scale_inv.repeat_interleave(2, dim=-2)[..., :3, :], (64, 128))
    with pytest.raises(ValueError, match="share one FP8 block"):
        fused_moe_w8a8(hidden, w13, w2_other_block, aligned, K)
    with pytest.raises(ValueError, match="w13, w2"):
        fused_moe_w8a8(hidden.to(torch.int32), w13, w2, aligned, K)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_gpu_bf16_at_deepseek_v3_ep8_shape(num_tokens):
    """H 7168, I 2048, 32 local experts, top-8. bf16 between the GEMMs can move an activation
    across an e4m3 boundary now and then (one step: at most 1/8 of that value), so the bound is
    on the relative norm, far below what a wrong scale or tile would give."""
    hidden_size, inter, experts, top_k = 7168, 2048, 32, 8
    w13 = fp8_experts(experts, 2, inter, hidden_size, "cuda", seed=1)
    w2 = fp8_experts(experts, 1, hidden_size, inter, "cuda", seed=2)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.rand(num_tokens, experts, device="cuda").topk(top_k, dim=-1).indices.to(torch.int32)
    aligned = moe_align_block_size(topk_ids, experts, block_m_for(num_tokens, top_k, experts))
    got = fused_moe_w8a8(hidden, w13, w2, aligned, top_k).float()
    want = fused_moe_w8a8_reference(hidden, w13, w2, aligned, top_k).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
