"""Dispatcher backends by name, each able to say why it cannot run a layout."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from moeserve.dispatch.all_to_all import AllToAllDispatcher
from moeserve.dispatch.base import Dispatcher
from moeserve.dispatch.local import LocalDispatcher
from moeserve.dispatch.nvshmem import NvshmemDispatcher
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.dispatch.rows import DispatchRows

DISPATCHERS: dict[str, type[Dispatcher]] = {
    backend.name: backend for backend in (LocalDispatcher, AllToAllDispatcher, NvshmemDispatcher)
}


def create_dispatcher(
    name: str,
    placement: ExpertPlacement,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
    rows: DispatchRows | None = None,
    **options: object,
) -> Dispatcher:
    """group: the EP process group, for backends that communicate (None: their default). rows:
    the model's dispatched rows, for backends that allocate their buffers at construction (the
    `nvshmem` backend needs them). The device, group and rows go to the backends whose
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
    given = {"group": group, "device": torch.device(device), "rows": rows}
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
