"""Dense gated MLP (SiLU(x W_gate) * x W_up) W_down, used by dense layers and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import GatedActivation
from moeserve.gated_activation import gated
from moeserve.models.fp8 import stored_weight
from moeserve.ops import TORCH_OPS, LayerOps


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
        activation: GatedActivation | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.activation = activation  # None: silu(gate) * up; DeepSeek-V4's shared expert clamps
        self.intermediate = intermediate
        # gate and up stacked in one GEMM: [2I, H]
        self.gate_up = nn.Parameter(
            torch.empty(2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.down = nn.Parameter(torch.empty(hidden, intermediate, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.ops.linear(x, stored_weight(self, "gate_up")).chunk(2, dim=-1)
        return self.ops.linear(gated(gate, up, self.activation), stored_weight(self, "down"))
