"""Logical experts (what the router picks) versus physical expert slots (what ranks hold).

With `R` redundant experts an EP group of `ep` ranks holds `P = E + R` physical slots, laid over
the ranks as `ExpertPlacement.contiguous(P, ep)` lays experts (rank r holds a contiguous run of
slot ids), so the dispatchers never learn that replicas exist: they move rows to physical slots.
What changes per MoE layer, and with each rebalance, is only which logical expert each slot holds:
`physical_to_logical[i][p]`. Every logical expert has at least one slot; a hot one may have
several, and the MoE block spreads its tokens over them (`replicas.ReplicaTable`).

Pure Python and plain data, so the balancer, the placement file and node 0 use it without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from moeserve.dispatch.placement import ExpertPlacement


@dataclass(frozen=True)
class ExpertMap:
    """Per MoE layer (in model order), the logical expert each physical slot holds.

    physical_to_logical: `[num_layers][P]`, P the same in every layer and at least E.
    num_logical:         E, the router's experts.
    ep_size:             ranks the P slots are spread over (contiguously, as `slot_placement` says).
    """

    physical_to_logical: tuple[tuple[int, ...], ...]
    num_logical: int
    ep_size: int

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.num_logical < 1:
            raise ValueError(f"need ep_size >= 1 and num_logical >= 1 (got {self.ep_size}, {self.num_logical})")
        sizes = {len(layer) for layer in self.physical_to_logical}
        if len(sizes) > 1:
            raise ValueError(f"every MoE layer must have the same number of physical slots (got {sorted(sizes)})")
        for i, layer in enumerate(self.physical_to_logical):
            if len(layer) < max(self.num_logical, self.ep_size):
                raise ValueError(
                    f"layer {i}: {len(layer)} physical slots cannot hold {self.num_logical} experts "
                    f"on {self.ep_size} ranks"
                )
            if any(not 0 <= e < self.num_logical for e in layer):
                raise ValueError(f"layer {i} names a logical expert outside [0, {self.num_logical})")
            missing = set(range(self.num_logical)) - set(layer)
            if missing:
                raise ValueError(f"layer {i} leaves logical experts {sorted(missing)[:8]} without a slot")

    @classmethod
    def default(cls, num_logical: int, num_redundant: int, ep_size: int, num_layers: int) -> ExpertMap:
        """Slot p holds expert p mod E in every layer: with no redundant experts, exactly today's
        contiguous split; the R extra slots replicate experts 0..R-1 until loads are known."""
        if num_redundant < 0:
            raise ValueError(f"num_redundant_experts must be >= 0 (got {num_redundant})")
        layer = tuple(p % num_logical for p in range(num_logical + num_redundant))
        return cls(tuple(layer for _ in range(num_layers)), num_logical, ep_size)

    @classmethod
    def initial(
        cls, num_logical: int, num_layers: int, ep_size: int, num_redundant: int, path: str | None
    ) -> ExpertMap:
        """The map an engine starts with: the placement file's if one is given (it must agree
        with the model, the EP size and the number of redundant experts), else `default`."""
        if path is None:
            return cls.default(num_logical, num_redundant, ep_size, num_layers)
        loaded = cls.load(path)
        loaded.check_model(num_logical, num_layers, ep_size)
        if loaded.num_redundant != num_redundant:
            raise ValueError(
                f"the expert placement {path} has {loaded.num_redundant} redundant experts; "
                f"--num-redundant-experts is {num_redundant}"
            )
        return loaded

    @property
    def num_layers(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical[0]) if self.physical_to_logical else self.num_logical

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_logical

    @cached_property
    def is_identity(self) -> bool:
        """No replicas and slot p holds expert p everywhere: dispatch can use the router's ids as they are."""
        identity = tuple(range(self.num_logical))
        return all(layer == identity for layer in self.physical_to_logical)

    def slot_placement(self, rank: int = 0) -> ExpertPlacement:
        """Physical slot -> rank, seen from `rank`: what every dispatcher is built with."""
        return ExpertPlacement.contiguous(self.num_physical, self.ep_size, rank)

    def slots_of(self, rank: int) -> tuple[int, ...]:
        return self.slot_placement().experts_of(rank)

    def local_logical(self, layer: int, rank: int) -> tuple[int, ...]:
        """The logical expert in each of `rank`'s slots of MoE layer `layer`, in slot order."""
        return tuple(self.physical_to_logical[layer][p] for p in self.slots_of(rank))

    def replicas(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """`[E]`: the physical slots of each logical expert in `layer`, ascending."""
        found: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.physical_to_logical[layer]):
            found[e].append(p)
        return tuple(tuple(slots) for slots in found)

    def rank_loads(self, layer: int, load: list[float] | tuple[float, ...]) -> list[float]:
        """Each rank's share of one layer's logical `load` `[E]`, a logical expert's load split
        evenly over its replicas (as the MoE block spreads its tokens)."""
        owner = self.slot_placement().expert_to_rank
        replicas = self.replicas(layer)
        per_rank = [0.0] * self.ep_size
        for e, slots in enumerate(replicas):
            for p in slots:
                per_rank[owner[p]] += load[e] / len(slots)
        return per_rank

    # ---- the placement file (`--expert-placement`) ------------------------------------------

    def to_json(self) -> dict:
        """`layers[i][r]`: the logical experts in rank r's slots of MoE layer i, in slot order."""
        return {
            "num_logical_experts": self.num_logical,
            "ep": self.ep_size,
            "layers": [[list(self.local_logical(i, r)) for r in range(self.ep_size)] for i in range(self.num_layers)],
        }

    @classmethod
    def from_json(cls, data: dict) -> ExpertMap:
        try:
            num_logical, ep, layers = int(data["num_logical_experts"]), int(data["ep"]), data["layers"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"an expert placement needs num_logical_experts, ep and layers ({exc})") from None
        if any(len(ranks) != ep for ranks in layers):
            raise ValueError(f"every layer of the placement must list the slots of each of its ep={ep} ranks")
        physical = tuple(tuple(int(e) for slots in ranks for e in slots) for ranks in layers)
        expert_map = cls(physical, num_logical, ep)
        for i, ranks in enumerate(layers):
            want = [len(expert_map.slots_of(r)) for r in range(ep)]
            if [len(slots) for slots in ranks] != want:
                raise ValueError(f"layer {i}: ranks hold {[len(s) for s in ranks]} slots; the split must be {want}")
        return expert_map

    def save(self, path: str | Path) -> None:
        """One line per MoE layer, so a placement reads (and diffs) layer by layer."""
        data = self.to_json()
        layers = ",\n  ".join(json.dumps(ranks) for ranks in data["layers"])
        head = json.dumps({k: v for k, v in data.items() if k != "layers"})[:-1]
        Path(path).write_text(f'{head}, "layers": [\n  {layers}\n]}}\n')

    @classmethod
    def load(cls, path: str | Path) -> ExpertMap:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the expert placement {path}: {exc}") from None

    def check_model(self, num_logical: int, num_layers: int, ep_size: int) -> None:
        """A clear error when this map was made for another model or EP size."""
        if (self.num_logical, self.num_layers, self.ep_size) != (num_logical, num_layers, ep_size):
            raise ValueError(
                f"the expert placement is for {self.num_logical} experts, {self.num_layers} MoE layers and ep="
                f"{self.ep_size}; this engine has {num_logical} experts, {num_layers} MoE layers and ep={ep_size}"
            )


def rank_imbalance(per_rank: list[float]) -> float:
    """max / mean of per-rank loads (1.0: perfect); 1.0 when nothing was routed."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
