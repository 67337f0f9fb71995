"""Dispatcher backends by name, each able to say why it cannot run a layout."""

from __future__ import annotations

import torch

from moeserve.dispatch.base import Dispatcher
from moeserve.dispatch.local import LocalDispatcher
from moeserve.dispatch.placement import ExpertPlacement

DISPATCHERS: dict[str, type[Dispatcher]] = {LocalDispatcher.name: LocalDispatcher}


def create_dispatcher(name: str, placement: ExpertPlacement, device: torch.device | str = "cpu") -> Dispatcher:
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; available: {sorted(DISPATCHERS)}")
    backend = DISPATCHERS[name]
    reason = backend.supports(placement, torch.device(device))
    if reason is not None:
        raise ValueError(f"dispatcher {name!r} cannot run here: {reason}")
    return backend(placement)
