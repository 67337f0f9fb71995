"""Routers: router logits -> top-k expert ids and weights, as each architecture defines them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import RouterConfig


class Router(nn.Module):
    def __init__(self, cfg: RouterConfig, hidden: int, num_experts: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        gate_dtype = torch.float32 if cfg.logits_in_fp32 else dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=gate_dtype, device=device), requires_grad=False)
        if cfg.has_correction_bias:
            # Kept in float32 whatever the model dtype: it shifts sigmoid scores by small amounts.
            self.correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32)."""
        if self.cfg.kind == "grouped_sigmoid":
            return self._grouped_sigmoid(x)
        logits = F.linear(x.float(), self.weight.float()) if self.cfg.logits_in_fp32 else F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.cfg.num_groups > 1:  # DeepSeek-V2: experts only from the groups with the best expert
            grouped = probs.view(x.shape[0], self.cfg.num_groups, self.num_experts // self.cfg.num_groups)  # [T, G, E/G]
            top_groups = grouped.amax(dim=-1).topk(self.cfg.topk_groups, dim=-1, sorted=False).indices
            keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, top_groups, True)
            probs = probs.masked_fill(~keep[:, :, None].expand_as(grouped).reshape_as(probs), 0.0)
        weights, ids = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.cfg.routed_scaling_factor

    def _grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3: pick top groups by the sum of their two best biased scores, then top-k
        experts inside them; weights are the unbiased scores of the chosen experts."""
        cfg, num_tokens = self.cfg, x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.correction_bias if cfg.has_correction_bias else scores
        grouped = biased.view(num_tokens, cfg.num_groups, self.num_experts // cfg.num_groups)  # [T, G, E/G] (explicit: T may be 0)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        top_groups = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, self.num_experts)
        ids = biased.masked_fill(~expert_mask, float("-inf")).topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if cfg.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor
