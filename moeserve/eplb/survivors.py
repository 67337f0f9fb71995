"""Where the experts go when ranks are lost (`--on-rank-failure heal`), and where each comes from.

The survivors keep the P physical slots between them, laid contiguously over the smaller group
as always (`ExpertPlacement.contiguous`), and keep the experts they hold: only the lost ranks'
slots need new homes, so the least weight moves while the server is paused. Every logical expert
must stay served: one no survivor holds any more goes first, to the survivor with the most free
slots, then the lost ranks' other slots (replicas of experts a survivor still holds) are given
out the same way, so each expert keeps as many replicas as it had. A live rebalance
(`--enable-eplb`) later balances the new group by measured load.

Each new slot is then filled from the best source: the rank's own copy, else a surviving replica
on another rank (point to point), else the checkpoint (the expert was only on lost ranks).
Pure Python: node 0 computes the map, every survivor the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from moeserve.dispatch.expert_map import ExpertMap
from moeserve.dispatch.placement import ExpertPlacement


def survivor_map(old: ExpertMap, survivors: Sequence[int]) -> ExpertMap:
    """The map over `survivors` (old ranks, ascending; the new rank r is `survivors[r]`)."""
    survivors = list(survivors)
    if not survivors or survivors != sorted(set(survivors)) or not 0 <= survivors[0] <= survivors[-1] < old.ep_size:
        raise ValueError(f"survivors must be distinct ranks of [0, {old.ep_size}) in ascending order: {survivors}")
    if old.num_physical < len(survivors):
        raise ValueError(f"{old.num_physical} expert slots cannot be spread over {len(survivors)} ranks")
    capacities = [len(slots) for slots in ExpertPlacement.contiguous(old.num_physical, len(survivors)).experts_by_rank]
    lost = [r for r in range(old.ep_size) if r not in survivors]
    layers = []
    for i in range(old.num_layers):
        contents = [list(old.local_logical(i, r))[:capacity] for r, capacity in zip(survivors, capacities)]
        homeless = [e for r in lost for e in old.local_logical(i, r)]
        homeless += [e for r, capacity in zip(survivors, capacities) for e in old.local_logical(i, r)[capacity:]]
        held = {e for experts in contents for e in experts}
        missing = [e for e in dict.fromkeys(homeless) if e not in held]
        replicas = list(homeless)
        for e in missing:
            replicas.remove(e)
        for e in missing + replicas:
            _give(e, contents, capacities)
        layers.append(tuple(e for experts in contents for e in experts))
    return ExpertMap(tuple(layers), old.num_logical, len(survivors))


def _give(expert: int, contents: list[list[int]], capacities: list[int]) -> None:
    """To the rank with the most free slots among those not holding `expert` yet (a second copy
    on one rank shares no load), the lowest rank on a tie; any rank with room if all hold it."""
    free = [(capacity - len(experts), -r) for r, (experts, capacity) in enumerate(zip(contents, capacities))]
    candidates = [r for r, experts in enumerate(contents) if free[r][0] > 0 and expert not in experts]
    if not candidates:
        candidates = [r for r in range(len(contents)) if free[r][0] > 0]
    contents[max(candidates, key=lambda r: free[r])].append(expert)


@dataclass(frozen=True)
class SlotSource:
    """Where one new local slot's weights come from.

    kind: "local" (this rank's old slot `src_slot`), "peer" (new rank `src`'s old slot
    `src_slot`) or "checkpoint" (`src` and `src_slot` are -1).
    """

    slot: int
    expert: int
    kind: Literal["local", "peer", "checkpoint"]
    src: int = -1
    src_slot: int = -1


def recovery_plan(old: ExpertMap, new: ExpertMap, survivors: Sequence[int], layer: int) -> list[list[SlotSource]]:
    """Per new rank, the source of each of its slots in MoE layer `layer`. A replica held by
    several survivors is read from them in turn (by destination and slot), so no one sender
    carries a whole lost rank's share."""
    held = [old.local_logical(layer, r) for r in survivors]
    holders = {e: [r for r, experts in enumerate(held) if e in experts] for e in range(old.num_logical)}
    plan = []
    for dst in range(new.ep_size):
        sources = []
        for slot, e in enumerate(new.local_logical(layer, dst)):
            if e in held[dst]:
                sources.append(SlotSource(slot, e, "local", dst, held[dst].index(e)))
            elif holders[e]:
                src = holders[e][(dst + slot) % len(holders[e])]
                sources.append(SlotSource(slot, e, "peer", src, held[src].index(e)))
            else:
                sources.append(SlotSource(slot, e, "checkpoint"))
        plan.append(sources)
    return plan
