"""Dispatcher backends by name, each able to say why it cannot run a layout."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeserve.dispatch.all_to_all import AllToAllDispatcher
from moeserve.dispatch.base import Dispatcher
from moeserve.dispatch.local import LocalDispatcher
from moeserve.dispatch.nvshmem import NvshmemDispatcher
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.dispatch.rows import DispatchRows

if TYPE_CHECKING:
    from moeserve.engine_config import ParallelConfig

DISPATCHERS: dict[str, type[Dispatcher]] = {
    backend.name: backend for backend in (LocalDispatcher, AllToAllDispatcher, NvshmemDispatcher)
}


def create_dispatcher(
    name: str,
    placement: ExpertPlacement,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    rows: DispatchRows | None = None,
    num_comm_sms: int | None = None,
    **options: object,
) -> Dispatcher:
    """group: the EP process group, for backends that communicate (None: their default). rows:
    the model's dispatched rows, for backends that allocate their buffers at construction (the
    `nvshmem` backend needs them). num_comm_sms: the SMs of backends whose kernels communicate
    (None: their default). The device, group, rows and num_comm_sms go to the backends whose
    constructors take them. options: backend-specific keywords (e.g. the `nvshmem` backend's
    `chunk_tokens`)."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; available: {sorted(DISPATCHERS)}")
    backend = DISPATCHERS[name]
    reason = backend.supports(placement, torch.device(device))
    if reason is not None:
        raise ValueError(f"dispatcher {name!r} cannot run here: {reason}")
    accepted = inspect.signature(backend).parameters
    if "rows" in accepted and rows is None:
        raise ValueError(f"dispatcher {name!r} allocates its buffer when built: pass the model's rows (DispatchRows)")
    given = {"group": group, "device": torch.device(device), "rows": rows, "num_comm_sms": num_comm_sms}
    return backend(placement, **{k: v for k, v in given.items() if k in accepted}, **options)


def a2a_backend_for(choice: str) -> str:
    """The dispatcher an EP engine uses for `--a2a-backend` (`auto`, `torch` or `nvshmem`).

    auto is `torch` everywhere for now: on CPU the nvshmem kernels run under Triton's interpreter,
    far slower than gloo, and on GPUs they have not yet been verified on a device."""
    if choice == "auto":
        return "torch"
    if choice not in ("torch", "nvshmem"):
        raise ValueError(f"unknown a2a backend {choice!r}; choose auto, torch or nvshmem")
    return choice


def ep_dispatcher(
    parallel: ParallelConfig,
    placement: ExpertPlacement,
    device: torch.device | str,
    group: dist.ProcessGroup | None,
    rows: DispatchRows,
) -> Dispatcher:
    """The dispatcher an expert-parallel rank serves with, as the engine's options say."""
    name = a2a_backend_for(parallel.a2a_backend)
    # Which peers the nvshmem kernels reach by stores, which by puts.
    options = {}
    if name == "nvshmem":
        options = {"nvlink_domain_size": parallel.load_store_ranks, "nvshmem_host": parallel.nvshmem_host}
    return create_dispatcher(
        name,
        placement,
        device,
        group=group,
        rows=rows,
        num_comm_sms=parallel.num_comm_sms,
        dispatch_fp8=parallel.dispatch_fp8,
        **options,
    )
