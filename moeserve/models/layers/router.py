"""Routers: router logits -> top-k expert ids and weights, as each architecture defines them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import RouterConfig
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.torch_ops import sqrtsoftplus_weights


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


class HashRouter(nn.Module):
    """DeepSeek-V4's `hash_moe` layers: each token's experts are fixed by its id (`tid2eid [V, K]`,
    frozen in the checkpoint); the gate's sqrtsoftplus scores only weight them. The ids it returns
    go through the same dispatch and combine as learned routing's."""

    def __init__(
        self,
        cfg: RouterConfig,
        hidden: int,
        num_experts: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.tid2eid = nn.Parameter(
            torch.zeros(vocab_size, cfg.top_k, dtype=torch.int64, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, H]`, token_ids `[T]` -> (topk_ids `[T, K]` int64, topk_weights `[T, K]` float32)."""
        scores = F.softplus(F.linear(x, self.weight)).sqrt()  # [T, E]
        ids = self.tid2eid[token_ids]
        return ids, sqrtsoftplus_weights(self.cfg, scores, ids).float()
