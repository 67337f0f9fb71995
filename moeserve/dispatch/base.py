"""The Dispatcher interface: how an MoE layer moves tokens to their experts and back.

Pipeline of one MoE layer (every backend, every device):

    router -> topk_ids [T, K], topk_weights [T, K]
           -> dispatch(): rows of `hidden` sent to the ranks holding their experts,
              received grouped by local expert                       -> DispatchOutput
           -> experts (grouped GEMM over the received rows)
           -> combine(): expert outputs sent back to their source rank and
              reduced over k with the top-k weights                  -> [T, H]

Contract every backend agrees on, bit for bit: for the same inputs `local`, `torch` and
`nvshmem` return the same combine() result. Nothing of a step is kept on the dispatcher: the
handle returned by dispatch() carries everything combine() needs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from moeserve.dispatch.placement import ExpertPlacement


@dataclass(frozen=True)
class DispatchHandle:
    """Backend-specific routing state from dispatch() to combine(). Subclassed per backend."""

    num_tokens: int  # T on the source rank; combine() returns [T, H]


@dataclass(frozen=True)
class DispatchOutput:
    """Tokens this rank's experts must process.

    hidden:                 `[N_recv, H]`, rows grouped by local expert (expert 0's rows first).
    num_tokens_per_expert:  per local expert, how many rows of `hidden` are its (sum = N_recv).
    handle:                 pass unchanged to combine().
    """

    hidden: torch.Tensor
    num_tokens_per_expert: tuple[int, ...]
    handle: DispatchHandle


class Dispatcher(ABC):
    """One all-to-all backend. Stateless between steps; safe to share across layers."""

    name: ClassVar[str]

    def __init__(self, placement: ExpertPlacement) -> None:
        self.placement = placement

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        """None if this backend can run the layout, else the reason it cannot."""
        return None

    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> DispatchOutput:
        """hidden `[T, H]`; topk_ids `[T, K]` int64 global expert ids; topk_weights `[T, K]` float32."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """expert_output `[N_recv, H]` in dispatch order -> `[T, H]`: sum over k of weight * output."""
