"""RMSNorm with the reference implementations' numerics (see `LayerOps.rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.ops import TORCH_OPS, LayerOps


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu", ops: LayerOps = TORCH_OPS
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the residual add before the norm, fused where the
        backend can (`LayerOps.add_rms_norm`)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
