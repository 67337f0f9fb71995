"""Filling a survivor's new expert slots after lost ranks (see `survivors.py` for the plan).

Every survivor runs `recover_layer` for each MoE layer, in the same order, over the new process
group: its own slots are copied locally, surviving replicas come point to point from the rank
holding them (`transfer.exchange_slots`, as a live rebalance moves weights), and experts that only the
lost ranks held are read from the checkpoint. The new tensors are built aside: the number of
slots a rank holds changes, so the layer's parameters are replaced, not overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeserve.eplb.survivors import SlotSource
from moeserve.eplb.transfer import Transfer, exchange_slots

ReadCheckpoint = Callable[[list[int]], list[torch.Tensor]]
"""Logical experts -> each expert parameter stacked over them, in the parameters' order."""


@dataclass
class Recovered:
    """What one survivor's recovery took: slots from peers and from the checkpoint, and bytes."""

    peer_slots: int = 0
    checkpoint_slots: int = 0
    peer_bytes: int = 0
    checkpoint_bytes: int = 0

    def add(self, other: Recovered) -> None:
        self.peer_slots += other.peer_slots
        self.checkpoint_slots += other.checkpoint_slots
        self.peer_bytes += other.peer_bytes
        self.checkpoint_bytes += other.checkpoint_bytes


def recover_layer(
    params: Sequence[torch.Tensor],
    plan: list[list[SlotSource]],
    rank: int,
    read_checkpoint: ReadCheckpoint,
    tag: int,
) -> tuple[list[torch.Tensor], Recovered]:
    """The layer's new expert parameters for `rank` (slot-major, as `params`), and what it took.
    `plan` is `recovery_plan`'s for this layer; every rank of the default group calls this with it."""
    mine = plan[rank]
    fresh = [p.new_empty(len(mine), *p.shape[1:]) for p in params]
    slot_bytes = sum(p[0].numel() * p.element_size() for p in params)
    moves = [
        Transfer(s.expert, dst if s.kind == "local" else s.src, s.src_slot, dst, s.slot)
        for dst, sources in enumerate(plan)
        for s in sources
        if s.kind != "checkpoint"
    ]
    exchange_slots(params, fresh, moves, rank, None, tag)
    from_peers = sum(1 for s in mine if s.kind == "peer")
    done = Recovered(peer_slots=from_peers, peer_bytes=from_peers * slot_bytes)
    from_checkpoint = [s for s in mine if s.kind == "checkpoint"]
    if from_checkpoint:
        read = read_checkpoint([s.expert for s in from_checkpoint])
        slots = [s.slot for s in from_checkpoint]
        for k, value in enumerate(read):
            fresh[k][slots] = value.to(device=fresh[k].device, dtype=fresh[k].dtype)
        done.checkpoint_slots += len(slots)
        done.checkpoint_bytes += len(slots) * slot_bytes
    return fresh, done
