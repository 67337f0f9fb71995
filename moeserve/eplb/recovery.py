"""Filling a survivor's new expert slots after lost ranks (see `survivors.py` for the plan).

Every survivor runs `recover_layer` for each MoE layer, in the same order, over the new process
group: its own slots are copied locally, surviving replicas come point to point from the rank
holding them (`batch_isend_irecv`, as a live rebalance moves weights), and experts that only the
lost ranks held are read from the checkpoint. The new tensors are built aside: the number of
slots a rank holds changes, so the layer's parameters are replaced, not overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.eplb.survivors import SlotSource

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
    done = Recovered()
    ops, inbox = [], []
    for dst, sources in enumerate(plan):
        if dst == rank:
            continue
        rows = [s.src_slot for s in sources if s.kind == "peer" and s.src == rank]
        if rows:
            index = torch.tensor(rows, device=params[0].device)
            for k, p in enumerate(params):
                ops.append(dist.P2POp(dist.isend, p.index_select(0, index).contiguous(), dst, tag=tag + k))
    for src in sorted({s.src for s in mine if s.kind == "peer"}):
        slots = [s.slot for s in mine if s.kind == "peer" and s.src == src]
        for k, p in enumerate(params):
            buffer = p.new_empty(len(slots), *p.shape[1:])
            ops.append(dist.P2POp(dist.irecv, buffer, src, tag=tag + k))
            inbox.append((k, slots, buffer))
        done.peer_slots += len(slots)
        done.peer_bytes += len(slots) * slot_bytes
    for s in mine:
        if s.kind == "local":
            for k, p in enumerate(params):
                fresh[k][s.slot] = p[s.src_slot]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for k, slots, buffer in inbox:
        fresh[k][slots] = buffer
    from_checkpoint = [s for s in mine if s.kind == "checkpoint"]
    if from_checkpoint:
        read = read_checkpoint([s.expert for s in from_checkpoint])
        slots = [s.slot for s in from_checkpoint]
        for k, value in enumerate(read):
            fresh[k][slots] = value.to(device=fresh[k].device, dtype=fresh[k].dtype)
        done.checkpoint_slots += len(slots)
        done.checkpoint_bytes += len(slots) * slot_bytes
    return fresh, done
