"""Which rank holds which expert.

A first-class object so that redundant experts and load balancing can replace the default
contiguous layout later without touching the loader or the dispatchers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    """Global expert id -> owning rank, seen from `rank`.

    expert_to_rank: `[num_experts]`, the rank that holds each global expert.
    """

    expert_to_rank: tuple[int, ...]
    ep_size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.ep_size:
            raise ValueError(f"rank {self.rank} outside [0, {self.ep_size})")
        if any(not 0 <= r < self.ep_size for r in self.expert_to_rank):
            raise ValueError("expert_to_rank names a rank outside the EP group")

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int = 1, rank: int = 0) -> "ExpertPlacement":
        """Experts split in contiguous runs; the first `num_experts % ep_size` ranks hold one more."""
        if num_experts < ep_size:
            raise ValueError(f"{num_experts} experts cannot be spread over {ep_size} ranks")
        base, extra = divmod(num_experts, ep_size)
        owners: list[int] = []
        for r in range(ep_size):
            owners += [r] * (base + (1 if r < extra else 0))
        return cls(expert_to_rank=tuple(owners), ep_size=ep_size, rank=rank)

    @property
    def num_experts(self) -> int:
        return len(self.expert_to_rank)

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """Global ids of the experts `rank` holds, ascending (its local expert order)."""
        return tuple(e for e, r in enumerate(self.expert_to_rank) if r == rank)

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.experts_of(self.rank)

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)
