"""How many rows each expert received: the load /metrics reports and a balancer would act on."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.dispatch.placement import ExpertPlacement


@dataclass(frozen=True)
class RoutedTokens:
    """Rows each expert received over a span of steps: `counts[i][e]` for the i-th MoE layer
    (decoder layer `layers[i]`) and global expert e; `placement` tells which rank holds e."""

    counts: list[list[int]]
    placement: ExpertPlacement
    layers: tuple[int, ...]

    def per_rank(self, i: int) -> list[int]:
        """Rows each rank's experts received in the i-th MoE layer."""
        load = [0] * self.placement.ep_size
        for expert, rows in enumerate(self.counts[i]):
            load[self.placement.expert_to_rank[expert]] += rows
        return load


def load_imbalance(load: list[int]) -> float | None:
    """max / mean of the ranks' loads (1.0 is perfect balance); None if nothing was routed."""
    mean = sum(load) / len(load)
    return max(load) / mean if mean else None
