"""MoE all-to-all: the Dispatcher interface, its backends and the expert placement."""

from moeserve.dispatch.all_to_all import AllToAllDispatcher
from moeserve.dispatch.base import Dispatcher, DispatchHandle, DispatchLayout, DispatchOutput
from moeserve.dispatch.local import LocalDispatcher
from moeserve.dispatch.nvshmem import NvshmemDispatcher
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.dispatch.registry import DISPATCHERS, a2a_backend_for, create_dispatcher

__all__ = [
    "AllToAllDispatcher",
    "DISPATCHERS",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchOutput",
    "Dispatcher",
    "ExpertPlacement",
    "LocalDispatcher",
    "NvshmemDispatcher",
    "a2a_backend_for",
    "create_dispatcher",
]
