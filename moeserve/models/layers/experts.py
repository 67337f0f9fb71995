"""The routed experts a rank holds, applied to the rows a dispatcher handed over."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import GatedActivation
from moeserve.dispatch import DispatchOutput
from moeserve.models.fp8 import stored_weight
from moeserve.ops import TORCH_OPS, LayerOps


class Experts(nn.Module):
    """E_local gated-MLP experts stored stacked, so a grouped GEMM kernel can take them as is.

    w13 `[E_local, 2 * I, H]`: gate rows then up rows of each expert.
    w2  `[E_local, H, I]`.
    b13 `[E_local, 2 * I]`, b2 `[E_local, H]`: biases, only with `bias` (gpt-oss).
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
        bias: bool = False,
        activation: GatedActivation | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.activation = activation
        self.w13 = nn.Parameter(
            torch.empty(num_local_experts, 2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_local_experts, hidden, intermediate, dtype=dtype, device=device), requires_grad=False
        )
        self.b13 = self.b2 = None
        if bias:
            self.b13 = nn.Parameter(
                torch.empty(num_local_experts, 2 * intermediate, dtype=dtype, device=device), requires_grad=False
            )
            self.b2 = nn.Parameter(
                torch.empty(num_local_experts, hidden, dtype=dtype, device=device), requires_grad=False
            )

    def forward(self, received: DispatchOutput) -> torch.Tensor:
        """The rows of a dispatch through their experts: what combine() takes (see `LayerOps.experts`).
        FP8 experts reach the backend as stored (bytes and scales), not dequantized; so do the
        rows of an FP8 dispatch, beside their dequantised values."""
        return self.ops.experts(
            received.hidden,
            received.layout,
            received.num_tokens_per_expert,
            received.topk_ids,
            stored_weight(self, "w13"),
            stored_weight(self, "w2"),
            self.b13,
            self.b2,
            self.activation,
            received.fp8_rows,
        )
