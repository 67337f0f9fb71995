"""DeepSeek-V4's RMSNorms: its weighted ones keep their weight in float32 and multiply in float32
(cast once at the end), and q's per-head norm and the hyper-connections' have no weight."""

from __future__ import annotations

import torch
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, the scale computed in float32, applied in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Float32RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)
