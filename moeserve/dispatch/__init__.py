"""MoE all-to-all: the Dispatcher interface, its backends, the expert placement (physical slot ->
rank) and the logical -> physical expert map with its device table (redundant experts)."""

from moeserve.dispatch.all_to_all import AllToAllDispatcher
from moeserve.dispatch.base import Dispatcher, DispatchHandle, DispatchLayout, DispatchOutput
from moeserve.dispatch.expert_map import ExpertMap, rank_imbalance
from moeserve.dispatch.local import LocalDispatcher
from moeserve.dispatch.nvshmem import NvshmemDispatcher
from moeserve.dispatch.placement import ExpertPlacement
from moeserve.dispatch.registry import DISPATCHERS, a2a_backend_for, create_dispatcher, ep_dispatcher
from moeserve.dispatch.replicas import ReplicaTable
from moeserve.dispatch.rows import DispatchRows

__all__ = [
    "AllToAllDispatcher",
    "DISPATCHERS",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchOutput",
    "DispatchRows",
    "Dispatcher",
    "ExpertMap",
    "ExpertPlacement",
    "LocalDispatcher",
    "NvshmemDispatcher",
    "ReplicaTable",
    "a2a_backend_for",
    "create_dispatcher",
    "ep_dispatcher",
    "rank_imbalance",
]
