"""RMSNorm kernels against the torch RMSNorm layer: fp32/fp16 under the interpreter, bf16 on GPU."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import ELEMENTWISE

from moeserve.kernels import norm as norm_kernels
from moeserve.kernels.norm import fused_add_rms_norm, rms_norm
from moeserve.models.layers.norm import RMSNorm

EPS = 1e-6


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    layer = RMSNorm(weight.shape[0], eps, weight.dtype, weight.device)
    layer.weight.data.copy_(weight)
    return layer(x)


def inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
    residual = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype).to(device)
    return x, residual, weight


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ELEMENTWISE[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("hidden", [16, 64])
def test_rms_norm_matches_reference(device: torch.device, dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, _, weight = inputs((tokens, hidden), dtype, device)
    assert_close(rms_norm(x, weight, EPS), reference(x, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [0, 1, 7])
@pytest.mark.parametrize("hidden", [16, 64])
def test_fused_add_rms_norm_matches_reference(
    device: torch.device, dtype: torch.dtype, tokens: int, hidden: int
) -> None:
    x, residual, weight = inputs((tokens, hidden), dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, x + residual)  # exactly torch's add in the model's dtype
    assert_close(normed, reference(x + residual, weight))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_fp16_rounds_where_the_reference_rounds(device: torch.device) -> None:
    """Rounding to fp16 before the weight multiply, as the reference does, is what makes nearly
    every element bit-identical (scaling in fp32 first leaves about a quarter of them off by an ulp),
    which the 1e-3 tolerance alone would not notice."""
    x, residual, weight = inputs((64, 64), torch.float16, device)
    assert (rms_norm(x, weight, EPS) == reference(x, weight)).float().mean() > 0.99
    normed, _ = fused_add_rms_norm(x, residual, weight, EPS)
    assert (normed == reference(x + residual, weight)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [40, 64])
def test_rows_wider_than_a_block_loop_over_chunks(
    device: torch.device, dtype: torch.dtype, hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(norm_kernels, "MAX_BLOCK", 16)  # 40: 3 chunks, the last one masked
    x, residual, weight = inputs((5, hidden), dtype, device)
    assert_close(rms_norm(x, weight, EPS), reference(x, weight))
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, x + residual)
    assert_close(normed, reference(x + residual, weight))


def test_per_head_norm_over_leading_dims(device: torch.device) -> None:
    """Qwen3's q/k norm: `[T, heads, D]`, normalised over D."""
    x, residual, weight = inputs((7, 4, 16), torch.float32, device)
    assert_close(rms_norm(x, weight, EPS), reference(x, weight))
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert new_residual.shape == x.shape and torch.equal(new_residual, x + residual)
    assert_close(normed, reference(x + residual, weight))


def test_strided_rows_and_zero_rows(device: torch.device) -> None:
    """Column slices of wider tensors (a row stride != H) are read in place; a zero row stays 0."""
    wide, wide_res, _ = inputs((7, 48), torch.float32, device)
    _, _, weight = inputs((7, 32), torch.float32, device)
    wide[3] = 0
    x, residual = wide[:, 8:40], wide_res[:, 8:40]
    out = rms_norm(x, weight, 1e-5)
    assert out.is_contiguous() and not out[3].any()
    assert_close(out, reference(x, weight, 1e-5))
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert_close(normed, reference(x + residual, weight, 1e-5))


def test_invalid_inputs_are_refused(device: torch.device) -> None:
    x, residual, weight = inputs((3, 16), torch.float32, device)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, weight[:8], EPS)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        rms_norm(x.to(torch.int32), weight, EPS)
    with pytest.raises(ValueError, match="non-empty last dim"):
        rms_norm(x[:, :0], weight[:0], EPS)
    with pytest.raises(ValueError, match="residual shape"):
        fused_add_rms_norm(x, residual[:2], weight, EPS)
    with pytest.raises(ValueError, match="residual dtype"):
        fused_add_rms_norm(x, residual.half(), weight, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [7168, 2048])
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_bf16_real_shapes(device: torch.device, hidden: int, tokens: int) -> None:
    """bf16 at DeepSeek-V3 (7168) and Qwen3-30B-A3B (2048) widths. The residual add is exact;
    the norm can differ from torch only where the fp32 variance's last bit moves a rounding."""
    x, residual, weight = inputs((tokens, hidden), torch.bfloat16, device)
    out = rms_norm(x, weight, EPS)
    expected = reference(x, weight)
    torch.testing.assert_close(out, expected)
    assert (out == expected).float().mean() > 0.99
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, x + residual)
    expected = reference(x + residual, weight)
    torch.testing.assert_close(normed, expected)
    assert (normed == expected).float().mean() > 0.99


@pytest.mark.gpu
def test_bf16_qk_norm_shape(device: torch.device) -> None:
    """Qwen3's per-head q norm: 4096 tokens x 32 heads x 128."""
    x, _, weight = inputs((4096, 32, 128), torch.bfloat16, device)
    out, expected = rms_norm(x, weight, EPS), reference(x, weight)
    torch.testing.assert_close(out, expected)
    assert (out == expected).float().mean() > 0.99
