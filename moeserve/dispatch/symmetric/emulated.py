"""`emulated` transport: N PEs inside one process, each PE's copy of a buffer an ordinary tensor.

Used by CI (on CPU, under Triton's interpreter) and by one GPU standing in for N. The PEs' kernels
cannot all be in flight at once here, so their work is interleaved step by step: a PE's dispatch
and combine are generators that yield wherever they need a peer's progress (`Dispatcher.*_steps`),
and `run_lockstep` advances every PE's generator by one step in turn until all have finished.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import torch

from moeserve.dispatch.symmetric.heap import SymmetricBuffer, SymmetricHeap


class EmulatedWorld:
    """The shared state of N emulated PEs: every allocation's N copies, by allocation order."""

    def __init__(self, world_size: int, device: torch.device | str = "cpu") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}")
        self.world_size, self.device = world_size, torch.device(device)
        self._copies: list[list[torch.Tensor]] = []
        self.heaps = [EmulatedHeap(self, rank) for rank in range(world_size)]

    def copies(self, index: int, nbytes: int) -> list[torch.Tensor]:
        """Allocation `index`'s copies, made by whichever PE asks first."""
        if index == len(self._copies):
            self._copies.append([torch.zeros(nbytes, dtype=torch.uint8, device=self.device) for _ in self.heaps])
        copies = self._copies[index]
        if copies[0].numel() != nbytes:
            raise ValueError(
                f"symmetric allocation {index} is {copies[0].numel()} bytes on another PE but {nbytes} here"
            )
        return copies


class EmulatedHeap(SymmetricHeap):
    name = "emulated"

    def __init__(self, world: EmulatedWorld, rank: int) -> None:
        super().__init__(rank, world.world_size, world.device)
        self.world = world
        self._allocated = 0

    def allocate(self, nbytes: int) -> SymmetricBuffer:
        copies = self.world.copies(self._allocated, nbytes)
        self._allocated += 1
        addresses = torch.tensor([c.data_ptr() for c in copies], dtype=torch.int64, device=self.device)
        return SymmetricBuffer(local=copies[self.rank], addresses=addresses, rank=self.rank)


def run_lockstep(steps: Sequence[Generator[None, None, Any]]) -> list[Any]:
    """Drive one generator per PE to completion, one step of each in rank order per round, and
    return their values. A step may wait only for steps that earlier rounds ran on other PEs."""
    results: list[Any] = [None] * len(steps)
    running = dict(enumerate(steps))
    while running:
        for rank, gen in list(running.items()):
            try:
                next(gen)
            except StopIteration as done:
                results[rank] = done.value
                del running[rank]
    return results
