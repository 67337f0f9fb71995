"""`local` backend (EP = 1): the reference every other backend is tested against.

Dispatch is a stable sort of the T*K (token, expert) pairs by expert; combine weights each
row and scatter-adds it back to its token. Because the sort is stable, each token's k
contributions are summed in ascending expert order, the same order as the HF reference loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.dispatch.base import DispatchHandle, Dispatcher, DispatchOutput
from moeserve.dispatch.placement import ExpertPlacement


@dataclass(frozen=True)
class LocalHandle(DispatchHandle):
    """src_token: `[N]` source token of each dispatched row; weights: `[N]` float32 its top-k weight."""

    src_token: torch.Tensor
    weights: torch.Tensor


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the flattened (token, k) pairs grouped by expert, and tokens per expert `[E]`."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


class LocalDispatcher(Dispatcher):
    name = "local"

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        if placement.ep_size != 1:
            return f"the local backend holds every expert in one process; ep={placement.ep_size} needs an all-to-all backend"
        return None

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        num_tokens, top_k = topk_ids.shape
        order, counts = sort_by_expert(topk_ids, self.placement.num_experts)
        src_token = order // top_k  # [N = T*K]
        handle = LocalHandle(num_tokens=num_tokens, src_token=src_token, weights=topk_weights.reshape(-1)[order])
        return DispatchOutput(
            hidden=hidden.index_select(0, src_token),
            num_tokens_per_expert=tuple(counts.tolist()),
            handle=handle,
        )

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        assert isinstance(handle, LocalHandle), f"local combine got a {type(handle).__name__}"
        weighted = expert_output * handle.weights.to(expert_output.dtype)[:, None]
        out = expert_output.new_zeros(handle.num_tokens, expert_output.shape[-1])
        return out.index_add_(0, handle.src_token, weighted)
