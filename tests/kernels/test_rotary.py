"""Rotary kernels against `layers.rotary.apply_rotary`: fp32/fp16 under the interpreter, bf16 on GPU.

cos/sin are random in the CPU tests, their two halves different, so that reading the wrong half
(or the wrong pair's frequency) cannot pass unnoticed; the GPU tests use real schedules.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import ELEMENTWISE

from moeserve.config import RopeConfig
from moeserve.kernels.rotary import apply_rotary, apply_rotary_qk_
from moeserve.models.layers.rotary import RotaryEmbedding
from moeserve.ops.rotary import apply_rotary as torch_apply_rotary


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The torch rotation on the first R dims, the rest passed through."""
    rotary_dim = cos.shape[-1]
    return torch.cat((torch_apply_rotary(x[..., :rotary_dim], cos, sin, interleaved), x[..., rotary_dim:]), dim=-1)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within tolerance; in fp16 also bit-identical, since each product and sum is rounded where
    torch rounds it (a tolerance of 1e-3 alone would let a fused fp32 multiply-add through)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ELEMENTWISE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
    if expected.dtype == torch.float16:
        assert torch.equal(actual, expected)


CASES = [(16, 16), (16, 8), (32, 32), (32, 16), (32, 6)]  # (head_dim, rotary_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("heads", [1, 3, 4])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), CASES)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_apply_rotary_matches_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, heads: int, head_dim: int, rotary_dim: int, interleaved: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + heads * 10 + head_dim + rotary_dim)
    x = randn((tokens, heads, head_dim), dtype, device, gen)
    cos, sin = randn((tokens, rotary_dim), dtype, device, gen), randn((tokens, rotary_dim), dtype, device, gen)
    x_before = x.clone()
    out = apply_rotary(x, cos, sin, interleaved)
    assert out.is_contiguous()
    assert_close(out, reference(x, cos, sin, interleaved))
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # pass-through is a copy
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (32, 16)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_apply_rotary_qk_in_place(
    device: torch.device, dtype: torch.dtype, tokens: int, head_dim: int, rotary_dim: int, interleaved: bool
) -> None:
    """GQA shapes: 4 query heads, 1 key head, one launch, written back into q and k."""
    gen = torch.Generator().manual_seed(tokens + head_dim + rotary_dim)
    q, k = randn((tokens, 4, head_dim), dtype, device, gen), randn((tokens, 1, head_dim), dtype, device, gen)
    cos, sin = randn((tokens, rotary_dim), dtype, device, gen), randn((tokens, rotary_dim), dtype, device, gen)
    q_expected, k_expected = reference(q, cos, sin, interleaved), reference(k, cos, sin, interleaved)
    assert apply_rotary_qk_(q, k, cos, sin, interleaved) is None
    assert_close(q, q_expected)
    assert_close(k, k_expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_mla_rope_views(device: torch.device, dtype: torch.dtype, interleaved: bool) -> None:
    """MLA rotates the last R dims of each query head and a `[T, R]` key shared by all heads:
    strided views in and out, the nope dims untouched; cos/sin strided too."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, nope, rope = 7, 3, 24, 8
    q = randn((tokens, heads, nope + rope), dtype, device, gen)
    kv = randn((tokens, 20 + rope), dtype, device, gen)  # [kv latent | k_rope], as kv_a_proj gives
    cos_sin = randn((tokens, 2 * rope + 4), dtype, device, gen)
    cos, sin = cos_sin[:, :rope], cos_sin[:, rope + 4 :]
    q_nope, q_rope = q.split([nope, rope], dim=-1)
    k_rope = kv[:, 20:]
    q_expected = torch.cat((q_nope, torch_apply_rotary(q_rope, cos, sin, interleaved)), dim=-1)
    k_expected = torch_apply_rotary(k_rope[:, None, :], cos, sin, interleaved)[:, 0]
    latent_before = kv[:, :20].clone()

    assert_close(apply_rotary(q_rope, cos, sin, interleaved), q_expected[..., nope:])
    apply_rotary_qk_(q_rope, k_rope[:, None, :], cos, sin, interleaved)
    assert_close(q, q_expected)
    assert_close(kv[:, 20:], k_expected)
    assert torch.equal(kv[:, :20], latent_before)


def test_invalid_inputs_are_refused(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    x = randn((3, 2, 16), torch.float32, device, gen)
    cos, sin = randn((3, 16), torch.float32, device, gen), randn((3, 16), torch.float32, device, gen)
    with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
        apply_rotary(x[:, 0], cos, sin, False)
    with pytest.raises(ValueError, match="cos and sin"):
        apply_rotary(x, cos, sin[:, :8], False)
    with pytest.raises(ValueError, match="tokens but cos/sin"):
        apply_rotary(x[:2], cos, sin, False)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        apply_rotary(x[..., :8], cos, sin, False)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        apply_rotary(x, cos[:, :5], sin[:, :5], False)
    with pytest.raises(ValueError, match="cos/sin dtypes"):
        apply_rotary(x, cos.half(), sin.half(), False)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        apply_rotary(x.to(torch.int32), cos, sin, False)
    with pytest.raises(ValueError, match="k has 2 tokens"):
        apply_rotary_qk_(x, x[:2].clone(), cos, sin, False)


def _cos_sin(cfg: RopeConfig, tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 160_000, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(device)
    return RotaryEmbedding(cfg, device).cos_sin(positions, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_bf16_qwen3(device: torch.device, tokens: int) -> None:
    """Qwen3-30B-A3B: 32 query heads, 4 KV heads, D 128, half-split. Each product and the sum
    are rounded as torch rounds them, so bf16 results are bit-identical."""
    gen = torch.Generator().manual_seed(tokens)
    cos, sin = _cos_sin(RopeConfig(theta=1_000_000.0, rotary_dim=128), tokens, device)
    q = randn((tokens, 32, 128), torch.bfloat16, device, gen)
    k = randn((tokens, 4, 128), torch.bfloat16, device, gen)
    q_expected, k_expected = torch_apply_rotary(q, cos, sin, False), torch_apply_rotary(k, cos, sin, False)
    assert torch.equal(apply_rotary(q, cos, sin, False), q_expected)
    apply_rotary_qk_(q, k, cos, sin, False)
    assert torch.equal(q, q_expected) and torch.equal(k, k_expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_bf16_deepseek_mla(device: torch.device, tokens: int) -> None:
    """DeepSeek-V3: 64 interleaved rope dims of 192 per query head (the last 64, as MLA splits
    them), YaRN; and the same 64 as the *first* dims of a head, the rest passed through."""
    gen = torch.Generator().manual_seed(tokens)
    cfg = RopeConfig(
        theta=10_000.0,
        rotary_dim=64,
        kind="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
        interleaved=True,
    )
    cos, sin = _cos_sin(cfg, tokens, device)
    q = randn((tokens, 16, 192), torch.bfloat16, device, gen)
    kv = randn((tokens, 512 + 64), torch.bfloat16, device, gen)
    q_nope, q_rope = q.split([128, 64], dim=-1)
    q_expected = torch.cat((q_nope, torch_apply_rotary(q_rope, cos, sin, True)), dim=-1)
    k_expected = torch_apply_rotary(kv[:, None, 512:], cos, sin, True)[:, 0]
    assert torch.equal(apply_rotary(q, cos, sin, True), reference(q, cos, sin, True))
    apply_rotary_qk_(q_rope, kv[:, None, 512:], cos, sin, True)
    assert torch.equal(q, q_expected) and torch.equal(kv[:, 512:], k_expected)
