"""`nvshmem` backend: dispatch/combine as one-sided NVSHMEM puts from device kernels.

Not runnable yet. The buffer layout and every index the kernels compute live in
`moeserve.dispatch.nvshmem_layout` and are tested on CPU against the `torch` backend; the device
kernels themselves (and the SM-partitioned compute/communication overlap) are not written, so
`supports()` refuses on every machine, naming each missing piece, and the constructor raises
ValueError with that reason. Nothing here pretends to run.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

from moeserve.dispatch.base import Dispatcher, DispatchHandle, DispatchOutput
from moeserve.dispatch.placement import ExpertPlacement

# Flipped when the Triton/NVSHMEM dispatch and combine kernels exist and pass on a GPU.
DEVICE_KERNELS_BUILT = False
KERNELS_MISSING = "the NVSHMEM device kernels are not built yet"


def _nvshmem_importable() -> bool:
    try:
        return importlib.util.find_spec("nvshmem.core") is not None
    except (ImportError, ValueError):  # parent package `nvshmem` missing or broken
        return False


class NvshmemDispatcher(Dispatcher):
    """Expert-parallel dispatch over NVSHMEM symmetric buffers (layout: `nvshmem_layout`)."""

    name = "nvshmem"

    def __init__(
        self,
        placement: ExpertPlacement,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """device: the CUDA device of this rank (None: the current one, or cpu without CUDA)."""
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        reason = self.supports(placement, torch.device(device))
        if reason is not None:
            raise ValueError(f"the nvshmem dispatcher cannot run here: {reason}")
        super().__init__(placement)  # unreachable until the kernels exist
        self.group = group

    @classmethod
    def supports(cls, placement: ExpertPlacement, device: torch.device) -> str | None:
        reasons = []
        if device.type != "cuda" or not torch.cuda.is_available():
            reasons.append(
                f"it needs a CUDA device (got {device}; torch.cuda.is_available()={torch.cuda.is_available()})"
            )
        if not _nvshmem_importable():
            reasons.append("nvshmem.core (nvshmem4py) is not importable")
        if not DEVICE_KERNELS_BUILT:
            reasons.append(KERNELS_MISSING)
        return "; ".join(reasons) or None

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        max_tokens_per_rank: int | None = None,
    ) -> DispatchOutput:
        raise NotImplementedError(KERNELS_MISSING)

    def combine(self, expert_output: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        raise NotImplementedError(KERNELS_MISSING)
