"""Symmetric memory: buffers every PE allocates alike, addressable from every peer's kernels."""

from moeserve.dispatch.symmetric.emulated import EmulatedHeap, EmulatedWorld, run_lockstep
from moeserve.dispatch.symmetric.heap import SymmetricBuffer, SymmetricHeap
from moeserve.dispatch.symmetric.shm import SharedMemoryBuffer, SharedMemoryHeap

__all__ = [
    "EmulatedHeap",
    "EmulatedWorld",
    "SharedMemoryBuffer",
    "SharedMemoryHeap",
    "SymmetricBuffer",
    "SymmetricHeap",
    "run_lockstep",
]
