"""Which rank holds which expert.

A first-class object so that redundant experts and load balancing can replace the default
contiguous layout later without touching the loader or the dispatchers. The tables derived from
`expert_to_rank` are computed once per placement (cached properties), not per dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Global expert id -> owning rank, seen from `rank`.

    expert_to_rank: `[num_experts]`, the rank that holds each global expert.

    Derived tables are `functools.cached_property`: they write straight into the instance's
    `__dict__`, which a frozen dataclass allows, and take no part in equality or hashing.
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
    def contiguous(cls, num_experts: int, ep_size: int = 1, rank: int = 0) -> ExpertPlacement:
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

    @cached_property
    def experts_by_rank(self) -> tuple[tuple[int, ...], ...]:
        """Per rank, the global ids of the experts it holds, ascending (its local expert order)."""
        return tuple(tuple(e for e, r in enumerate(self.expert_to_rank) if r == rank) for rank in range(self.ep_size))

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """Global ids of the experts `rank` holds, ascending (its local expert order)."""
        return self.experts_by_rank[rank]

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.experts_by_rank[self.rank]

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    @cached_property
    def max_local_experts(self) -> int:
        """L: the most experts any rank holds; buffers padded per rank to L experts use it."""
        return max(len(experts) for experts in self.experts_by_rank)

    @cached_property
    def local_index(self) -> tuple[int, ...]:
        """`[E]`: each global expert's index among its owner's local experts."""
        index = [0] * self.num_experts
        for experts in self.experts_by_rank:
            for i, e in enumerate(experts):
                index[e] = i
        return tuple(index)

    @cached_property
    def expert_slot(self) -> torch.Tensor:
        """`[E]` int64 on the CPU: owner * L + local index, a global expert's (rank, local expert)
        cell in a `[ep, L]` table; sorting pairs by it groups them by rank, then local expert."""
        owner = torch.tensor(self.expert_to_rank, dtype=torch.int64)
        return owner * self.max_local_experts + torch.tensor(self.local_index, dtype=torch.int64)

    @cached_property
    def owner(self) -> torch.Tensor:
        """`[E]` int64 on the CPU: `expert_to_rank` as a tensor, for device-side lookups."""
        return torch.tensor(self.expert_to_rank, dtype=torch.int64)
