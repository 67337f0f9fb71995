"""Symmetric memory: buffers every PE allocates alike, addressable from every peer's kernels."""

from moeserve.dispatch.symmetric.emulated import EmulatedHeap, EmulatedWorld, run_lockstep
from moeserve.dispatch.symmetric.heap import SymmetricBuffer, SymmetricHeap

__all__ = ["EmulatedHeap", "EmulatedWorld", "SymmetricBuffer", "SymmetricHeap", "run_lockstep"]
