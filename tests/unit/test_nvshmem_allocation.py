"""The `nvshmem` backend allocates its symmetric buffer when it is built, never in a dispatch.

Allocating in the first dispatch let a fast peer store rows into a slow rank's buffer before that
rank's zero-fill ran (`dispatch.rows`). Two emulated PEs whose heaps record what they hand out:
the buffer exists, zeroed and of the layout's size, before any dispatch; dispatch and combine in
both modes then use that one buffer and allocate nothing more.
"""

from __future__ import annotations

import torch
from helpers.routing import routing

from moeserve.dispatch import DispatchRows, ExpertPlacement
from moeserve.dispatch.nvshmem import NvshmemDispatcher
from moeserve.dispatch.nvshmem_layout import SymmetricLayout
from moeserve.dispatch.symmetric import EmulatedHeap, EmulatedWorld, SymmetricBuffer, run_lockstep

ROWS = DispatchRows(hidden_size=16, top_k=2, dtype=torch.bfloat16)
CHUNK = 4


class RecordingHeap(EmulatedHeap):
    """An emulated PE's heap that keeps every buffer it hands out."""

    def __init__(self, world: EmulatedWorld, rank: int) -> None:
        super().__init__(world, rank)
        self.allocations: list[SymmetricBuffer] = []

    def allocate(self, nbytes: int) -> SymmetricBuffer:
        buffer = super().allocate(nbytes)
        self.allocations.append(buffer)
        return buffer


def test_buffer_is_allocated_at_construction_and_only_then() -> None:
    world = EmulatedWorld(2)
    heaps = [RecordingHeap(world, rank) for rank in range(2)]
    placements = [ExpertPlacement.contiguous(6, 2, rank) for rank in range(2)]
    dispatchers = [
        NvshmemDispatcher(p, ROWS, heap=h, chunk_tokens=CHUNK, dispatch_fp8=True) for p, h in zip(placements, heaps)
    ]
    layout = SymmetricLayout.for_rows(placements[0], ROWS, CHUNK, dispatch_fp8=True)
    for heap in heaps:
        assert [b.nbytes for b in heap.allocations] == [layout.nbytes]
        assert not heap.allocations[0].local.any(), "the buffer must be zeroed before any peer stores into it"

    g = torch.Generator().manual_seed(3)
    inputs = []
    for tokens in (3, 9):  # 9 > CHUNK: the high-throughput mode's notify round and three chunks
        ids = routing("uniform", tokens, 6, ROWS.top_k, g)
        inputs.append((torch.randn(tokens, ROWS.hidden_size, generator=g).to(ROWS.dtype), ids, torch.rand(tokens, 2)))
    for bound in (CHUNK, None):
        sent = run_lockstep(
            [d.dispatch_steps(*inputs[r if bound is None else 0], bound) for r, d in enumerate(dispatchers)]
        )
        run_lockstep([d.combine_steps(o.hidden, o.handle) for d, o in zip(dispatchers, sent)])

    for heap in heaps:
        assert len(heap.allocations) == 1, "a dispatch allocated"
        signals = heap.allocations[0].view(
            layout.offsets["dispatch_signal"], (layout.slots * layout.groups,), torch.int64
        )
        assert signals.any(), "the dispatches did not go through the buffer allocated at construction"
