"""The torch backend's RMSNorm on CPU (torch's `rms_norm` call) equals HF's definition bit for bit."""

from __future__ import annotations

import pytest
import torch

from moeserve.ops import TORCH_OPS


def definition(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, op by op."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (7, 100), (64, 2048), (300, 7168), (5, 8, 128), (0, 64)])
def test_equals_the_definition_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=g)).to(dtype)
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    got = TORCH_OPS.rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and torch.equal(got, definition(x, weight, 1e-6))
