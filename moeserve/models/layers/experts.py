"""The routed experts a rank holds, applied to tokens already grouped by expert."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """E_local gated-MLP experts stored stacked, so a grouped GEMM kernel can take them as is.

    w13 `[E_local, 2 * I, H]`: gate rows then up rows of each expert.
    w2  `[E_local, H, I]`.
    """

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden, intermediate, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: Sequence[int]) -> torch.Tensor:
        """x `[N, H]`, rows grouped by local expert in order, `num_tokens_per_expert[e]` rows each.

        Torch path: one GEMM pair per expert that received tokens; empty experts cost nothing.
        """
        out = torch.empty_like(x)
        start = 0
        for expert, count in enumerate(num_tokens_per_expert):
            if count == 0:
                continue
            rows = x[start : start + count]
            gate, up = F.linear(rows, self.w13[expert]).chunk(2, dim=-1)
            out[start : start + count] = F.linear(F.silu(gate) * up, self.w2[expert])
            start += count
        return out
