"""`local` backend (EP = 1): the reference every other backend is tested against.

Nothing moves: dispatch() hands the tokens over as they are (TOKEN_MAJOR) with the router's ids,
so the experts' grouped GEMM gathers rows by expert itself (`fused_moe` does it on the fly), and
the only work here is counting pairs per expert on the device. combine() is `weighted_sum`.
With `dispatch_fp8` the tokens are quantised in place of the send (`fp8.local_rows`) and handed
over as FP8 rows and dequantised, so one process computes what an EP group sending FP8 rows computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.dispatch.base import Dispatcher, DispatchHandle, DispatchLayout, DispatchOutput
from moeserve.dispatch.combine import weighted_sum
from moeserve.dispatch.counts import count_per_expert
from moeserve.dispatch.fp8 import local_rows
from moeserve.dispatch.placement import ExpertPlacement


@dataclass(frozen=True)
class LocalHandle(DispatchHandle):
    """topk_ids `[T, K]` int64 and topk_weights `[T, K]` float32: dispatch()'s own inputs."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class LocalDispatcher(Dispatcher):
    name = "local"

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        if placement.ep_size != 1:
            return (
                f"the local backend holds every expert in one process; ep={placement.ep_size} "
                "needs an all-to-all backend"
            )
        return None

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> DispatchOutput:
        """See `Dispatcher.dispatch`; the bound is not needed (nothing is sent)."""
        num_tokens = topk_ids.shape[0]
        fp8_rows = local_rows(hidden) if self.dispatch_fp8 else None
        return DispatchOutput(
            hidden=hidden if fp8_rows is None else fp8_rows.dequantize(hidden.dtype),
            fp8_rows=fp8_rows,
            num_tokens_per_expert=count_per_expert(topk_ids, self.placement.num_experts),
            layout=DispatchLayout.TOKEN_MAJOR,
            topk_ids=topk_ids,
            handle=LocalHandle(num_tokens=num_tokens, topk_ids=topk_ids, topk_weights=topk_weights),
        )

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        assert isinstance(handle, LocalHandle), f"local combine got a {type(handle).__name__}"
        return weighted_sum(expert_output, handle.topk_ids, handle.topk_weights, handle.sum_order)
