"""The routed experts a rank holds, applied to tokens already grouped by expert."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from moeserve.ops import TORCH_OPS, LayerOps


class Experts(nn.Module):
    """E_local gated-MLP experts stored stacked, so a grouped GEMM kernel can take them as is.

    w13 `[E_local, 2 * I, H]`: gate rows then up rows of each expert.
    w2  `[E_local, H, I]`.
    """

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str = "cpu", ops: LayerOps = TORCH_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden, intermediate, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: Sequence[int]) -> torch.Tensor:
        """x `[N, H]`, rows grouped by local expert in order, `num_tokens_per_expert[e]` rows each."""
        return self.ops.experts(x, num_tokens_per_expert, self.w13, self.w2)
