"""The EPLB balancer: hand-made cases, the brute-force optimum on small ones, a skewed load."""

from __future__ import annotations

import itertools
import random

import pytest

from moeserve.dispatch import ExpertMap
from moeserve.eplb.balancer import balance, imbalance, pack, replicate


def peak(expert_map: ExpertMap, load: list[float]) -> float:
    return max(expert_map.rank_loads(0, load))


def optimum(load: list[float], capacities: list[int]) -> float:
    """The smallest possible largest rank load over every replica count and every assignment of
    replicas to ranks (each rank exactly its capacity), by enumeration."""
    num_slots, best = sum(capacities), float("inf")
    for cuts in itertools.combinations(range(1, num_slots), len(load) - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, num_slots))]
        weights = [load[e] / counts[e] for e in range(len(load)) for _ in range(counts[e])]
        for ranks in set(itertools.permutations(r for r, c in enumerate(capacities) for _ in range(c))):
            per_rank = [0.0] * len(capacities)
            for w, r in zip(weights, ranks):
                per_rank[r] += w
            best = min(best, max(per_rank))
    return best


def test_replicate_gives_extra_slots_to_the_hottest_per_replica():
    assert replicate([8, 1, 1, 2], 7) == [4, 1, 1, 1]
    assert replicate([6, 1, 5, 0], 6) == [2, 1, 2, 1]
    assert replicate([1, 1, 1], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        replicate([1, 1, 1], 2)


def test_pack_hand_cases():
    # 5+3 | 4+4; then 7 | 2+2+2+1, where the capacities force the heavy item alone.
    where = pack([5, 4, 4, 3], [2, 2])
    assert sorted(sum(w for w, b in zip([5, 4, 4, 3], where) if b == r) for r in range(2)) == [8, 8]
    where = pack([7, 2, 2, 2, 1], [1, 4])
    assert where == [0, 1, 1, 1, 1]
    # pairs only: 6 + 3 is the least the heaviest item can be paired to
    weights = [6, 5, 4, 3, 3, 3]
    where = pack(weights, [2, 2, 2])
    assert max(sum(w for w, b in zip(weights, where) if b == r) for r in range(3)) == 9
    with pytest.raises(ValueError, match="exactly"):
        pack([1, 2, 3], [2, 2])


def test_one_hot_expert_is_spread_over_every_rank():
    load = [90.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    expert_map = balance([load], num_physical=8, ep_size=4)
    assert len(expert_map.replicas(0)[0]) == 3  # the two extra slots both replicate expert 0
    assert max(expert_map.rank_loads(0, load)) == pytest.approx(32.0)  # 30 + 2: every rank has two slots
    assert {expert_map.slot_placement().expert_to_rank[p] for p in expert_map.replicas(0)[0]} == {0, 1, 2}


CASES = [
    (num_experts, ep, num_redundant, seed)
    for num_experts, ep, num_redundant in [(3, 2, 1), (4, 2, 0), (4, 2, 2), (4, 3, 2), (5, 2, 1), (5, 3, 1), (3, 3, 3)]
    for seed in range(4)
]


@pytest.mark.parametrize("num_experts,ep,num_redundant,seed", CASES)
def test_within_five_percent_of_brute_force(num_experts, ep, num_redundant, seed):
    rng = random.Random(seed)
    load = [float(rng.choice([rng.randint(1, 10), rng.randint(1, 100)])) for _ in range(num_experts)]
    num_physical = num_experts + num_redundant
    expert_map = balance([load], num_physical, ep)
    capacities = [len(expert_map.slots_of(r)) for r in range(ep)]
    assert peak(expert_map, load) <= 1.05 * optimum(load, capacities)


@pytest.mark.parametrize("ep", [4, 8])
def test_zipf_load_balances_to_within_fifteen_percent(ep):
    """The acceptance's skewed router: Zipf-like loads over 32 experts, R = E / 4."""
    num_experts, layers = 32, 3
    loads = [[1000.0 / (1 + (e * 7 + 3 * i) % num_experts) ** 1.1 for e in range(num_experts)] for i in range(layers)]
    before = imbalance(ExpertMap.default(num_experts, 0, ep, layers), loads)
    after = imbalance(balance(loads, num_experts + num_experts // 4, ep), loads)
    assert before[1] > 1.5
    assert after[1] <= 1.15


def test_hierarchical_keeps_each_expert_on_one_node():
    """Two nodes of two ranks: every replica of an expert sits on the node it was packed onto,
    and the balance is still near even."""
    load = [40.0, 30.0, 8.0, 6.0, 5.0, 5.0, 3.0, 3.0]
    expert_map = balance([load], num_physical=12, ep_size=4, num_nodes=2)
    owner = expert_map.slot_placement().expert_to_rank
    for slots in expert_map.replicas(0):
        assert len({owner[p] // 2 for p in slots}) == 1
    node_load = [sum(expert_map.rank_loads(0, load)[2 * n : 2 * n + 2]) for n in range(2)]
    assert max(node_load) / (sum(load) / 2) < 1.1
    assert imbalance(expert_map, [load])[1] < 1.2


def test_previous_map_keeps_experts_in_place():
    """Rebalancing a map onto the loads it was made for moves nothing, and aligning with a
    previous map never changes the balance."""
    rng = random.Random(5)
    loads = [[float(rng.randint(1, 50)) for _ in range(16)] for _ in range(2)]
    first = balance(loads, 20, 4)
    shifted = ExpertMap(tuple(layer[5:] + layer[:5] for layer in first.physical_to_logical), 16, 4)  # ranks rotated
    again = balance(loads, 20, 4, previous=shifted)
    assert again == shifted
    other = [[float(rng.randint(1, 50)) for _ in range(16)] for _ in range(2)]
    assert imbalance(balance(other, 20, 4, previous=first), other) == imbalance(balance(other, 20, 4), other)
