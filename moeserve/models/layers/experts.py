"""The routed experts a rank holds, applied to the rows a dispatcher handed over."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.dispatch import DispatchOutput
from moeserve.ops import TORCH_OPS, LayerOps


class Experts(nn.Module):
    """E_local gated-MLP experts stored stacked, so a grouped GEMM kernel can take them as is.

    w13 `[E_local, 2 * I, H]`: gate rows then up rows of each expert.
    w2  `[E_local, H, I]`.
    """

    def __init__(
        self,
        num_local_experts: int,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.w13 = nn.Parameter(
            torch.empty(num_local_experts, 2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_local_experts, hidden, intermediate, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, received: DispatchOutput) -> torch.Tensor:
        """The rows of a dispatch through their experts: what combine() takes (see `LayerOps.experts`)."""
        return self.ops.experts(
            received.hidden, received.layout, received.num_tokens_per_expert, received.topk_ids, self.w13, self.w2
        )
