"""Routers: router logits -> top-k expert ids and weights, as each architecture defines them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import RouterConfig
from moeserve.ops import TORCH_OPS, LayerOps


class Router(nn.Module):
    def __init__(
        self,
        cfg: RouterConfig,
        hidden: int,
        num_experts: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.num_experts = num_experts
        gate_dtype = torch.float32 if cfg.logits_in_fp32 else dtype
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden, dtype=gate_dtype, device=device), requires_grad=False
        )
        self.bias = None
        if cfg.has_bias:  # gpt-oss: added to the logits, in the gate's dtype
            self.bias = nn.Parameter(torch.empty(num_experts, dtype=gate_dtype, device=device), requires_grad=False)
        if cfg.has_correction_bias:
            # Kept in float32 whatever the model dtype: it shifts sigmoid scores by small amounts.
            self.correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32)."""
        if self.cfg.kind == "grouped_sigmoid" or self.cfg.logits_in_fp32:
            logits = F.linear(x.float(), self.weight.float())  # [T, E]
        else:
            logits = F.linear(x, self.weight, self.bias)
        return self.ops.route(self.cfg, logits, getattr(self, "correction_bias", None))
