"""Dense gated MLP (SiLU(x W_gate) * x W_up) W_down, used by dense layers and shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.intermediate = intermediate
        # gate and up stacked in one GEMM: [2I, H]
        self.gate_up = nn.Parameter(
            torch.empty(2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.down = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)
