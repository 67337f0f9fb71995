"""The balancer: measured loads -> which logical expert each physical slot holds.

DeepSeek's EPLB, written from its description. Per MoE layer:

1. replicate: every logical expert gets one slot; each of the R redundant slots goes, one at a
   time, to the expert whose load per replica is then largest. This minimises the largest load
   per replica (the greedy choice is optimal for that: each step removes the current maximum).
   Since that is not always the count that packs best, a bounded search then moves single
   replicas between experts while the packed peak drops (`balance_layer`).
2. pack: the replicas (each carrying load / replicas of its expert) go onto ranks, heaviest
   first, each to the least-loaded rank with a free slot; then pairs of replicas are swapped
   between the most-loaded rank and another while that lowers the pair's larger load. Every
   swap lowers the sum of squared rank loads, so the search ends.

With several nodes (hierarchical, DeepSeek's choice when the group divides evenly): experts are
first packed onto nodes (E / nodes each, the same greedy packing), then replicated and packed
onto the node's ranks inside each node, so a token's replicas never add cross-node traffic
beyond its expert's home node.

Pure functions on plain numbers: the same loads give the same map on every rank, which is what
lets every rank compute the next placement itself.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from moeserve.dispatch.expert_map import ExpertMap
from moeserve.dispatch.placement import ExpertPlacement


def replicate(load: Sequence[float], num_slots: int) -> list[int]:
    """`[E]` replica counts summing to num_slots: each extra slot to the largest load per replica."""
    if num_slots < len(load):
        raise ValueError(f"{num_slots} slots cannot hold {len(load)} experts")
    counts = [1] * len(load)
    heap = [(-float(w), e) for e, w in enumerate(load)]  # (-load per replica, expert): ties to the lower id
    heapq.heapify(heap)
    for _ in range(num_slots - len(load)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def pack(weights: Sequence[float], capacities: Sequence[int]) -> list[int]:
    """Each item's bin: bin b takes exactly capacities[b] items (their sum must be len(weights)),
    the largest bin load as small as the greedy packing and swap search get it."""
    if sum(capacities) != len(weights):
        raise ValueError(f"{len(weights)} items do not fill bins of {list(capacities)} exactly")
    loads, room = [0.0] * len(capacities), list(capacities)
    where = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(len(room)) if room[b]), key=lambda b: (loads[b], b))
        where[i], loads[b], room[b] = b, loads[b] + weights[i], room[b] - 1
    _swap_down(weights, where, loads)
    return where


def _swap_down(weights: Sequence[float], where: list[int], loads: list[float]) -> None:
    """Swap items out of the most-loaded bin while a swap lowers that pair's larger load."""
    for _ in range(len(weights) ** 2):
        top = max(range(len(loads)), key=lambda b: (loads[b], -b))
        best, best_peak = None, loads[top]
        for i in (i for i, b in enumerate(where) if b == top):
            for j, other in enumerate(where):
                delta = weights[i] - weights[j]
                if other == top or delta <= 0:
                    continue
                peak = max(loads[top] - delta, loads[other] + delta)
                if peak < best_peak - 1e-12 * max(1.0, loads[top]):
                    best, best_peak = (i, j), peak
        if best is None:
            return
        i, j = best
        delta, other = weights[i] - weights[j], where[j]
        where[i], where[j] = other, top
        loads[top] -= delta
        loads[other] += delta


def balance_layer(load: Sequence[float], capacities: Sequence[int]) -> list[int]:
    """One layer, one level: `[P]` logical expert per physical slot, P = sum(capacities), rank
    r's slots contiguous and in ascending logical order.

    The replica counts that minimise the largest load per replica need not pack best (a third
    replica of a hot expert can leave no rank a light partner for it), so after packing them the
    counts are adjusted: one replica moved from an expert that can spare one to a heavy one,
    kept if the packed peak drops, a few candidates per round, a bounded number of rounds."""
    counts = replicate(load, sum(capacities))
    peak, experts, where = _packed(load, counts, capacities)
    for _ in range(_ROUNDS):
        donors = sorted((e for e, n in enumerate(counts) if n > 1), key=lambda e: (load[e] / (counts[e] - 1), e))
        takers = sorted(range(len(load)), key=lambda e: (-load[e] / counts[e], e))
        best = None
        for a in donors[:_CANDIDATES]:
            for b in takers[:_CANDIDATES]:
                if a == b:
                    continue
                trial = list(counts)
                trial[a], trial[b] = trial[a] - 1, trial[b] + 1
                packed = _packed(load, trial, capacities)
                if packed[0] < (best[0][0] if best else peak) * (1 - 1e-9):
                    best = (packed, trial)
        if best is None:
            break
        (peak, experts, where), counts = best
    return [e for r in range(len(capacities)) for e in sorted(x for x, b in zip(experts, where) if b == r)]


_ROUNDS = 8  # replica-count adjustments per layer (each tries _CANDIDATES**2 packings)
_CANDIDATES = 4


def _packed(
    load: Sequence[float], counts: Sequence[int], capacities: Sequence[int]
) -> tuple[float, list[int], list[int]]:
    """(largest rank load, the expert of each replica, each replica's rank) for these counts."""
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    weights = [load[e] / counts[e] for e in experts]
    where = pack(weights, capacities)
    per_rank = [0.0] * len(capacities)
    for w, r in zip(weights, where):
        per_rank[r] += w
    return max(per_rank), experts, where


def balance_layer_hierarchical(load: Sequence[float], capacities: Sequence[int], num_nodes: int) -> list[int]:
    """Experts onto nodes first (E / nodes each), then `balance_layer` inside each node. Needs E,
    the ranks and the slots to split evenly over the nodes; otherwise one level, globally."""
    num_experts, ranks = len(load), len(capacities)
    if num_nodes <= 1 or num_experts % num_nodes or ranks % num_nodes or sum(capacities) % num_nodes:
        return balance_layer(load, capacities)
    per_node = ranks // num_nodes
    node_capacity = [sum(capacities[n * per_node : (n + 1) * per_node]) for n in range(num_nodes)]
    if len(set(node_capacity)) > 1:
        return balance_layer(load, capacities)
    node_of = pack(load, [num_experts // num_nodes] * num_nodes)
    slots: list[int] = []
    for n in range(num_nodes):
        members = [e for e in range(num_experts) if node_of[e] == n]
        inner = balance_layer([load[e] for e in members], capacities[n * per_node : (n + 1) * per_node])
        slots += [members[i] for i in inner]
    return slots


def balance(
    loads: Sequence[Sequence[float]],
    num_physical: int,
    ep_size: int,
    num_nodes: int = 1,
    previous: ExpertMap | None = None,
) -> ExpertMap:
    """loads `[num_layers][E]` (rows routed to each logical expert over the window) -> an
    `ExpertMap` of `num_physical` slots over `ep_size` ranks on `num_nodes` nodes.

    previous: the map in use, if any. Ranks of one node with the same capacity are
    interchangeable in a packing, so each new rank's set of experts goes to the rank that already
    holds most of them (largest overlaps first): the same balance, fewer weights moved."""
    if not loads:
        raise ValueError("no MoE layer to balance")
    capacities = [len(s) for s in ExpertPlacement.contiguous(num_physical, ep_size).experts_by_rank]
    per_node = ep_size // num_nodes if num_nodes > 0 and ep_size % num_nodes == 0 else ep_size
    layers = []
    for i, load in enumerate(loads):
        slots = balance_layer_hierarchical(load, capacities, num_nodes)
        if previous is not None:
            slots = _align(slots, capacities, previous.local_logical, i, per_node)
        layers.append(tuple(slots))
    return ExpertMap(tuple(layers), len(loads[0]), ep_size)


def _align(slots: list[int], capacities: Sequence[int], held, layer: int, per_node: int) -> list[int]:
    """`slots` with whole ranks' contents permuted among ranks of one node and one capacity, so
    each rank keeps as many of the experts it holds (`held(layer, rank)`) as a greedy matching finds."""
    starts = [sum(capacities[:r]) for r in range(len(capacities))]
    bins = [slots[starts[r] : starts[r] + capacities[r]] for r in range(len(capacities))]
    old = [held(layer, r) for r in range(len(capacities))]
    given: list[list[int]] = [[] for _ in bins]
    for node in range(len(bins) // per_node):
        ranks = range(node * per_node, (node + 1) * per_node)
        pairs = [(_overlap(bins[b], old[r]), b, r) for b in ranks for r in ranks if capacities[b] == capacities[r]]
        placed: set[int] = set()
        for _, b, r in sorted(pairs, key=lambda x: (-x[0], x[1], x[2])):
            if b not in placed and not given[r]:
                given[r] = bins[b]
                placed.add(b)
    return [e for contents in given for e in contents]


def _overlap(a: Sequence[int], b: Sequence[int]) -> int:
    """Size of the multiset intersection: slots that can keep their expert."""
    rest = list(b)
    count = 0
    for e in a:
        if e in rest:
            rest.remove(e)
            count += 1
    return count


def imbalance(expert_map: ExpertMap, loads: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(mean, worst) over layers of max / mean rank load, each expert's load split evenly over
    its replicas (as the MoE block spreads it); 1.0 is perfect balance."""
    ratios = []
    for i, load in enumerate(loads):
        per_rank = expert_map.rank_loads(i, list(load))
        mean = sum(per_rank) / len(per_rank)
        ratios.append(max(per_rank) / mean if mean else 1.0)
    return sum(ratios) / len(ratios), max(ratios)
