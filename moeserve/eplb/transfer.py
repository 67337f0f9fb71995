"""Moving expert weights to the slots a new expert map gives them, rank to rank.

Every rank computes the same plan from the old and new maps (no communication to agree on it):
a new slot whose logical expert the rank already holds is filled by a local copy; any other is
sent by one old holder of that expert (chosen round-robin over its holders by destination, so a
replicated expert's sends are shared out). The sends and receives of one MoE layer go out
together as point-to-point operations over the EP process group (`batch_isend_irecv`): rank to
rank, never through rank 0, and never from the checkpoint. A layer's new weights are built
aside and copied into the parameters once every receive is in, so a slot is never overwritten
before it was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moeserve.dispatch.expert_map import ExpertMap


@dataclass(frozen=True)
class Transfer:
    """Logical expert `expert` from `src`'s local slot `src_slot` to `dst`'s local slot `dst_slot`."""

    expert: int
    src: int
    src_slot: int
    dst: int
    dst_slot: int


def plan_layer(old: ExpertMap, new: ExpertMap, layer: int) -> list[Transfer]:
    """Every new slot's source, for every rank (local copies have src == dst)."""
    held = [old.local_logical(layer, r) for r in range(old.ep_size)]
    holders = [[r for r in range(old.ep_size) if e in held[r]] for e in range(old.num_logical)]
    plan = []
    for dst in range(new.ep_size):
        for dst_slot, e in enumerate(new.local_logical(layer, dst)):
            src = dst if e in held[dst] else holders[e][(dst + dst_slot) % len(holders[e])]
            plan.append(Transfer(e, src, held[src].index(e), dst, dst_slot))
    return plan


@dataclass(frozen=True)
class Moved:
    """What a move cost: slots sent between ranks and their bytes, over the whole EP group
    (every rank computes the same totals), and this rank's share received."""

    experts: int
    bytes: int
    bytes_received: int


def move_experts(
    experts: Sequence[nn.Module],
    old: ExpertMap,
    new: ExpertMap,
    rank: int,
    group: dist.ProcessGroup | None = None,
) -> Moved:
    """Rewrite each MoE layer's expert parameters (every parameter of `experts[i]`, slot-major:
    dim 0 is the local slot) from `old`'s slots to `new`'s. Every rank of the group calls it
    with the same maps."""
    if (old.num_physical, old.ep_size) != (new.num_physical, new.ep_size):
        raise ValueError("a rebalance keeps the number of slots and ranks")
    moved = total = received = 0
    for i, module in enumerate(experts):
        params = list(module.parameters())
        plan = plan_layer(old, new, i)
        slot_bytes = sum(p[0].numel() * p.element_size() for p in params)
        remote = [t for t in plan if t.src != t.dst]
        moved += len(remote)
        total += len(remote) * slot_bytes
        received += sum(slot_bytes for t in remote if t.dst == rank)
        _move_layer(params, plan, rank, group, tag=i * len(params))
    return Moved(moved, total, received)


def _move_layer(
    params: list[torch.Tensor], plan: list[Transfer], rank: int, group: dist.ProcessGroup | None, tag: int
) -> None:
    fresh = [torch.empty_like(p) for p in params]
    exchange_slots(params, fresh, plan, rank, group, tag)
    with torch.no_grad():
        for p, value in zip(params, fresh):
            p.copy_(value)


def exchange_slots(
    params: Sequence[torch.Tensor],
    fresh: Sequence[torch.Tensor],
    plan: Sequence[Transfer],
    rank: int,
    group: dist.ProcessGroup | None,
    tag: int,
) -> None:
    """Fill `fresh` (this rank's new slots, slot-major as `params`) from `plan`: this rank's own
    slots copied locally, every other rank's point to point in one `batch_isend_irecv`, one tag
    per parameter from `tag`. Every rank of the group calls it with the same plan."""
    ops, inbox = [], []
    for peer in sorted({t.dst for t in plan if t.src == rank and t.dst != rank}):
        rows = torch.tensor([t.src_slot for t in plan if t.src == rank and t.dst == peer], device=params[0].device)
        for k, p in enumerate(params):
            ops.append(dist.P2POp(dist.isend, p.index_select(0, rows), _global(peer, group), group, tag + k))
    for peer in sorted({t.src for t in plan if t.dst == rank and t.src != rank}):
        slots = [t.dst_slot for t in plan if t.dst == rank and t.src == peer]
        for k, p in enumerate(params):
            buffer = p.new_empty(len(slots), *p.shape[1:])
            ops.append(dist.P2POp(dist.irecv, buffer, _global(peer, group), group, tag + k))
            inbox.append((k, slots, buffer))
    for t in plan:
        if t.dst == rank and t.src == rank:
            for k, p in enumerate(params):
                fresh[k][t.dst_slot] = p[t.src_slot]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for k, slots, buffer in inbox:
        fresh[k][slots] = buffer


def _global(rank: int, group: dist.ProcessGroup | None) -> int:
    """The default group's rank of `rank` in `group` (P2POp takes global ranks)."""
    return rank if group is None else dist.get_global_rank(group, rank)
