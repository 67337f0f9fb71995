"""Where the experts go when the group changes (`--on-rank-failure heal`): ranks lost, or ranks
back (a restarted rank rejoining), and where each new slot's weights come from.

The ranks keep the P physical slots between them, laid contiguously over the new group as
always (`ExpertPlacement.contiguous`), and keep the experts they hold as far as their new share
of slots allows: only the lost ranks' slots (and what no longer fits) need new homes, so the
least weight moves while the server is paused. Every logical expert must stay served: one no
remaining rank holds any more goes first, to the rank with the most free slots, then the other
homeless slots (replicas of experts a rank still holds) are given out the same way, so each
expert keeps as many replicas as it had. A returned rank starts empty: the slots the others can
no longer fit are its share. A live rebalance (`--enable-eplb`) later balances the new group by
measured load.

Each new slot is then filled from the best source: the rank's own copy, else a replica on
another rank (point to point), else the checkpoint (the expert was only on lost ranks).
Pure Python: every rank computes the same map and the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from moeserve.dispatch.expert_map import ExpertMap
from moeserve.dispatch.placement import ExpertPlacement


def survivor_map(old: ExpertMap, previous: Sequence[int | None]) -> ExpertMap:
    """The map over a new group whose rank r was rank `previous[r]` of `old`'s (ascending),
    or None for a rank that joins holding nothing; old ranks left out are lost."""
    kept = [r for r in previous if r is not None]
    if not kept or kept != sorted(set(kept)) or not 0 <= kept[0] <= kept[-1] < old.ep_size:
        raise ValueError(f"survivors must be distinct ranks of [0, {old.ep_size}) in ascending order: {list(previous)}")
    if old.num_physical < len(previous):
        raise ValueError(f"{old.num_physical} expert slots cannot be spread over {len(previous)} ranks")
    capacities = [len(slots) for slots in ExpertPlacement.contiguous(old.num_physical, len(previous)).experts_by_rank]
    lost = [r for r in range(old.ep_size) if r not in kept]
    layers = []
    for i in range(old.num_layers):
        held = [() if r is None else old.local_logical(i, r) for r in previous]
        contents = [list(experts[:capacity]) for experts, capacity in zip(held, capacities)]
        homeless = [e for r in lost for e in old.local_logical(i, r)]
        homeless += [e for experts, capacity in zip(held, capacities) for e in experts[capacity:]]
        present = {e for experts in contents for e in experts}
        missing = [e for e in dict.fromkeys(homeless) if e not in present]
        replicas = list(homeless)
        for e in missing:
            replicas.remove(e)
        for e in missing + replicas:
            _give(e, contents, capacities)
        layers.append(tuple(e for experts in contents for e in experts))
    return ExpertMap(tuple(layers), old.num_logical, len(previous))


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


def recovery_plan(old: ExpertMap, new: ExpertMap, previous: Sequence[int | None], layer: int) -> list[list[SlotSource]]:
    """Per new rank, the source of each of its slots in MoE layer `layer` (`previous` as
    `survivor_map` takes it). A replica held by several ranks is read from them in turn (by
    destination and slot), so no one sender carries a whole lost rank's share."""
    held = [() if r is None else old.local_logical(layer, r) for r in previous]
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
