"""How many rows each expert received: the load /metrics reports and a balancer would act on."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.dispatch.expert_map import ExpertMap
from moeserve.dispatch.wire import WireVolume


@dataclass(frozen=True)
class RoutedTokens:
    """Rows routed over a span of steps, per MoE layer (the i-th is decoder layer `layers[i]`).

    counts:    `[i][e]`: rows logical expert e received, all its replicas together.
    rank_rows: `[i][r]`: rows rank r's expert slots received (its share of the work).
    wire:      rows each rank dispatched to each rank, all layers together (None at ep = 1).
    """

    counts: list[list[int]]
    rank_rows: list[list[int]]
    layers: tuple[int, ...]
    wire: WireVolume | None = None

    def per_rank(self, i: int) -> list[int]:
        """Rows each rank's experts received in the i-th MoE layer."""
        return list(self.rank_rows[i])

    @classmethod
    def from_ranks(
        cls, per_rank: list[list[list[int]]], layers: tuple[int, ...], wire: WireVolume | None = None
    ) -> RoutedTokens:
        """per_rank[r]: rank r's `logical_rows`, `[i][e]`."""
        num_layers = len(per_rank[0])
        counts = [[sum(column) for column in zip(*(rank[i] for rank in per_rank))] for i in range(num_layers)]
        return cls(counts, [[sum(rank[i]) for rank in per_rank] for i in range(num_layers)], layers, wire)


def logical_rows(slot_rows: list[list[int]], expert_map: ExpertMap, rank: int) -> list[list[int]]:
    """`[i][s]` rows each of `rank`'s slots received -> `[i][e]` per logical expert, under the
    map the slots held when the rows were counted."""
    out = []
    for i, rows in enumerate(slot_rows):
        per_expert = [0] * expert_map.num_logical
        for e, n in zip(expert_map.local_logical(i, rank), rows):
            per_expert[e] += n
        out.append(per_expert)
    return out


def load_imbalance(load: list[int]) -> float | None:
    """max / mean of the ranks' loads (1.0 is perfect balance); None if nothing was routed."""
    mean = sum(load) / len(load)
    return max(load) / mean if mean else None
