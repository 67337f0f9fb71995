"""The MoE block: router -> dispatch -> experts -> combine, plus the optional shared expert.

Model code talks only to the `Dispatcher` interface, so EP backends slot in without changes here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.dispatch import Dispatcher
from moeserve.models.layers.experts import Experts
from moeserve.models.layers.mlp import GatedMLP
from moeserve.models.layers.router import Router
from moeserve.ops import TORCH_OPS, LayerOps


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dispatcher: Dispatcher, dtype: torch.dtype, device: torch.device | str = "cpu", ops: LayerOps = TORCH_OPS) -> None:
        super().__init__()
        self.dispatcher = dispatcher
        self.router = Router(cfg.router, cfg.hidden_size, cfg.num_experts, dtype, device, ops)
        self.experts = Experts(dispatcher.placement.num_local_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device, ops)
        self.routed_tokens = [0] * dispatcher.placement.num_local_experts
        """Rows each local expert received since `take_routed_tokens()`: the load /metrics reports."""
        self.shared = None
        self.shared_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, device)
            if cfg.shared_expert_gated:
                self.shared_gate = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)

    def take_routed_tokens(self) -> list[int]:
        counts, self.routed_tokens = self.routed_tokens, [0] * len(self.routed_tokens)
        return counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H]` -> `[T, H]`."""
        topk_ids, topk_weights = self.router(x)  # [T, K], [T, K]
        received = self.dispatcher.dispatch(x, topk_ids, topk_weights)
        self.routed_tokens = [a + b for a, b in zip(self.routed_tokens, received.num_tokens_per_expert)]
        expert_out = self.experts(received.hidden, received.num_tokens_per_expert)  # [N_recv, H]
        out = self.dispatcher.combine(expert_out, received.handle)  # [T, H]
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out
