"""A workload's recorded expert load (`--record-expert-load FILE`), and the placement made from it
(`moeserve eplb plan`): the static counterpart of live rebalancing, for a known traffic mix.

The file: {"num_logical_experts": E, "moe_layers": [decoder layer ids], "loads": [[rows per
logical expert] per MoE layer]}, rows summed over every rank and every step the engine reported.
"""

from __future__ import annotations

import json
from pathlib import Path


class LoadRecord:
    """Sums `RoutedTokens.counts` reports; written once, at shutdown."""

    def __init__(self, path: str | Path, num_logical: int, moe_layers: tuple[int, ...]) -> None:
        self.path, self.num_logical, self.moe_layers = Path(path), num_logical, moe_layers
        self.loads = [[0] * num_logical for _ in moe_layers]

    def add(self, counts: list[list[int]]) -> None:
        for total, rows in zip(self.loads, counts):
            for e, n in enumerate(rows):
                total[e] += n

    def save(self) -> None:
        data = {"num_logical_experts": self.num_logical, "moe_layers": list(self.moe_layers), "loads": self.loads}
        self.path.write_text(json.dumps(data) + "\n")


def read_loads(path: str | Path) -> list[list[int]]:
    """The `loads` of a recorded file, checked for shape."""
    try:
        data = json.loads(Path(path).read_text())
        loads, num_logical = data["loads"], int(data["num_logical_experts"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read recorded expert loads from {path}: {exc}") from None
    if not loads or any(len(layer) != num_logical for layer in loads):
        raise ValueError(f"{path}: every MoE layer needs one load per each of the {num_logical} experts")
    return [[int(n) for n in layer] for layer in loads]
