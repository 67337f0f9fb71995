"""The load statistics the balancer reads: routed pairs per (MoE layer, logical expert) over the
last N steps, kept on the device so that recording a step costs no host sync.

Each MoE block counts, cumulatively, the pairs its rank's tokens route to each logical expert
(`MoEBlock.logical_load`, counted at the router: the load is the same whatever the placement).
After every step the window stores a snapshot of those counters in a ring of N + 1; the load
over the last N steps is the newest snapshot minus the one N steps older. Only a rebalance reads
it back (and sums it over the EP group), so the statistics are gathered at the cost of one small
all-reduce every `eplb_interval_steps` steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class CountsLogicalLoad(Protocol):
    logical_load: torch.Tensor | None

    def track_logical_load(self) -> None: ...


class LoadWindow:
    """ring: int64 `[N + 1, num_layers, E]` on the blocks' device, cumulative snapshots."""

    def __init__(self, blocks: Sequence[CountsLogicalLoad], window_steps: int) -> None:
        if window_steps < 1:
            raise ValueError(f"the load window needs at least one step (got {window_steps})")
        for block in blocks:
            block.track_logical_load()
        self.counters = [block.logical_load for block in blocks]
        first = self.counters[0]
        assert first is not None
        self.window_steps = window_steps
        self.ring = torch.zeros(window_steps + 1, len(blocks), first.shape[0], dtype=torch.int64, device=first.device)
        self.ring[0] = torch.stack(self.counters)  # type: ignore[arg-type]
        self.steps = 0

    def record(self) -> None:
        """Snapshot the counters after a step (a device copy, no sync)."""
        self.steps += 1
        self.ring[self.steps % (self.window_steps + 1)] = torch.stack(self.counters)  # type: ignore[arg-type]

    def loads(self) -> torch.Tensor:
        """int64 `[num_layers, E]`: pairs routed by this rank's tokens over the last
        min(steps, N) steps."""
        size = self.window_steps + 1
        oldest = max(self.steps - self.window_steps, 0)
        return self.ring[self.steps % size] - self.ring[oldest % size]

    def restart_at(self, steps: int) -> None:
        """Count on from step `steps` with an empty window: a returned rank, which must rebalance
        at the same steps as the group it joins, has no load of its own before it."""
        self.ring[:] = torch.stack(self.counters)  # type: ignore[arg-type]
        self.steps = steps
