"""The packed-expert grouped GEMMs (INT4 W4A16, NVFP4 and MXFP4 dequantized in the kernel) against
their torch reference, which dequantizes with the formats' own code (`int4_format`,
`nvfp4_format`, `mxfp4_format`, themselves checked against compressed-tensors, the ModelOpt
rule and transformers' FP4 decode in the parity tests).

Both sides round the weight values to hidden's dtype and accumulate in fp32; in fp32 they differ
by summation order only, fp16 adds its own rounding of the stored intermediates.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from moeserve import int4_format, mxfp4_format, nvfp4_format
from moeserve.config import GatedActivation
from moeserve.kernels.moe_align import moe_align_block_size
from moeserve.kernels.packed_moe import PackedExperts, packed_moe, packed_moe_reference

E, K = 4, 2
# (hidden, expert width) per format: several K tiles (BLOCK_K 32) in both GEMMs, the last one
# partial where the format's group allows it (NVFP4: 16), gate and up meeting inside an N tile
# (BLOCK_N 64).
SHAPES = {"int4": (96, 96), "nvfp4": (80, 48), "mxfp4": (96, 64)}
H, I = SHAPES["nvfp4"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def int4_experts(parts: int, rows: int, cols: int, seed: int) -> PackedExperts:
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(parts * rows, cols, generator=g) * (e + 1) / cols**0.5 for e in range(E)]
    packed = [int4_format.quantize(w, 32) for w in weights]
    return PackedExperts(torch.stack([c for c, _ in packed]), torch.stack([s for _, s in packed]))


def nvfp4_experts(parts: int, rows: int, cols: int, seed: int) -> PackedExperts:
    """Each part a checkpoint tensor of its own, with its own global scale (gate and up)."""
    g = torch.Generator().manual_seed(seed)
    codes, scales, globals_ = [], [], []
    for e in range(E):
        each = [
            nvfp4_format.quantize(torch.randn(rows, cols, generator=g) * (e + p + 1) / cols**0.5) for p in range(parts)
        ]
        codes.append(torch.cat([c for c, _, _ in each]))
        scales.append(torch.cat([s for _, s, _ in each]))
        globals_.append(torch.stack([t for _, _, t in each]))
    return PackedExperts(torch.stack(codes), torch.stack(scales), torch.stack(globals_))


def mxfp4_experts(parts: int, rows: int, cols: int, seed: int) -> PackedExperts:
    """DeepSeek-V4's FP4 experts as the model holds them: codes `[E, N, K / 2]`, e8m0 bytes."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(parts * rows, cols, generator=g) * (e + 1) / cols**0.5 for e in range(E)]
    packed = [mxfp4_format.quantize(w) for w in weights]
    return PackedExperts(torch.stack([c.flatten(-2) for c, _ in packed]), torch.stack([s for _, s in packed]))


MAKERS = {"int4": int4_experts, "nvfp4": nvfp4_experts, "mxfp4": mxfp4_experts}


def on(w: PackedExperts, device) -> PackedExperts:
    moved = w.global_scales.to(device) if w.nvfp4 else None
    return PackedExperts(w.codes.to(device), w.scales.to(device), moved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", MAKERS)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_packed_moe_matches_reference(fmt, dtype, num_tokens, device):
    hidden_size, inter = SHAPES[fmt]
    w13, w2 = (
        on(MAKERS[fmt](2, inter, hidden_size, seed=1), device),
        on(MAKERS[fmt](1, hidden_size, inter, seed=2), device),
    )
    g = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=g).to(dtype).to(device)
    topk_ids = torch.rand(num_tokens, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    pair_weights = torch.rand(num_tokens * K, generator=g).to(device)
    aligned = moe_align_block_size(topk_ids, E, 16)
    got = packed_moe(hidden, w13, w2, aligned, K, pair_weights, max_programs=3)
    want = packed_moe_reference(hidden, w13, w2, aligned, K, pair_weights)
    assert got.dtype == dtype and got.shape == (num_tokens * K, hidden_size)
    assert (got.float() - want.float()).abs().max().item() <= TOL[dtype] * want.float().abs().max().item()
    assert want.abs().max() > 0


def test_clamped_silu_between_the_launches(device):
    """DeepSeek-V4's clamped SiLU (its released experts are FP4) between the packed GEMMs: the
    reference's, and the clamp at 1 bites (the plain SiLU result differs)."""
    w13, w2 = on(nvfp4_experts(2, I, H, seed=1), device), on(nvfp4_experts(1, H, I, seed=2), device)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, H, generator=g).to(device)
    topk_ids = torch.rand(5, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    aligned = moe_align_block_size(topk_ids, E, 16)
    clamped = GatedActivation("clamped_silu", limit=1.0)
    got = packed_moe(hidden, w13, w2, aligned, K, activation=clamped)
    want = packed_moe_reference(hidden, w13, w2, aligned, K, activation=clamped)
    assert (got - want).abs().max().item() <= TOL[torch.float32] * want.abs().max().item()
    assert (got - packed_moe(hidden, w13, w2, aligned, K)).abs().max().item() > 1e-2 * got.abs().max().item()


def test_global_scales_apply_per_part_and_shapes_are_checked():
    """Gate and up read their own global scale: doubling up's doubles the up half only."""
    w = nvfp4_experts(2, I, H, seed=3)
    doubled = PackedExperts(w.codes, w.scales, w.global_scales * torch.tensor([1.0, 2.0]))
    assert torch.equal(doubled.dequantize(torch.float32)[:, :I], w.dequantize(torch.float32)[:, :I])
    assert torch.equal(doubled.dequantize(torch.float32)[:, I:], 2 * w.dequantize(torch.float32)[:, I:])
    with pytest.raises(ValueError, match="do not cut 80 inputs into whole groups"):
        PackedExperts(w.codes, w.scales[..., :3], w.global_scales)
    with pytest.raises(ValueError, match="need torch.int32 codes"):
        PackedExperts(w.codes, w.scales.float())
    mx = mxfp4_experts(1, I, 96, seed=4)  # 96 inputs under 2 scales: groups of 48, not 32
    with pytest.raises(ValueError, match="do not cut 96 inputs into whole groups"):
        PackedExperts(mx.codes[..., :48], mx.scales[..., :2])


@pytest.mark.parametrize("arch,fmt", [("deepseek_v3", "int4"), ("qwen3_moe", "nvfp4")])
def test_packed_model_on_triton_equals_the_torch_path(make_checkpoint, tmp_path, device, monkeypatch, arch, fmt):
    """A whole INT4 / NVFP4 model on the Triton kernels: the experts run the packed GEMMs on the
    stored codes (never a dequantized copy) and give the torch path's logits. Both are weight-only
    in float32, so they differ by summation order only."""
    from helpers.reference import prefill_logits

    from moeserve.checkpoints import quantize_int4, quantize_nvfp4
    from moeserve.models import load_model
    from moeserve.ops import create_ops
    from moeserve.packed_weight import PackedExperts

    overrides = {"num_experts": 4} if arch == "qwen3_moe" else {}
    folder = shutil.copytree(make_checkpoint(arch, 2, **overrides), tmp_path / fmt)
    (quantize_int4 if fmt == "int4" else quantize_nvfp4).quantize_checkpoint(folder)
    prompts = [[5, 9, 11, 13, 17], [7], [21, 4, 8, 30, 2, 99, 140]]
    want = prefill_logits(load_model(folder, device=device), prompts)
    triton_path = load_model(folder, device=device, ops=create_ops("triton", device))
    with monkeypatch.context() as patch:
        patch.setattr(PackedExperts, "dequantize", lambda *_: pytest.fail("Triton path dequantized packed experts"))
        got = prefill_logits(triton_path, prompts)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
