"""Logical expert ids -> physical slots, on the device, before the all-to-all.

Each (token, k) pair of logical expert e goes to replica `(t + rank) mod n_e` of e's `n_e`
slots: deterministic, no communication, and a hot expert's pairs split over its replicas within
one of each other, whichever ranks they come from (the `+ rank` keeps every rank's first token
from landing on the same replica). Which replica serves a pair does not change its result: the
replicas hold the same weights, and combine sums each token's k rows in logical-id order
(`DispatchHandle.sum_order`).
"""

from __future__ import annotations

import torch


class ReplicaTable:
    """One MoE layer's logical -> physical table, built once per placement, used every step.

    slots:  int64 `[E, max_replicas]` on the device: e's physical slots, ascending, the row padded
            by repeating its first slot (never chosen: the index is taken mod `count`).
    count:  int64 `[E]`: replicas of each logical expert.
    """

    def __init__(self, replicas: tuple[tuple[int, ...], ...], rank: int, device: torch.device | str) -> None:
        """replicas: `ExpertMap.replicas(layer)`; rank: this rank in the EP group."""
        if any(not slots for slots in replicas):
            raise ValueError("every logical expert needs at least one physical slot")
        width = max(len(slots) for slots in replicas)
        rows = [list(slots) + [slots[0]] * (width - len(slots)) for slots in replicas]
        self.slots = torch.tensor(rows, dtype=torch.int64, device=device)
        self.count = torch.tensor([len(slots) for slots in replicas], dtype=torch.int64, device=device)
        self.rank = rank
        self.has_replicas = width > 1

    def physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """int64 `[T, K]` logical ids -> int64 `[T, K]` physical slots (distinct per token, as
        the logical ids are: each slot holds one logical expert)."""
        if not self.has_replicas:
            return self.slots[topk_ids, 0]
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]  # [T, 1]
        choice = (token + self.rank) % self.count[topk_ids]  # [T, K]
        return self.slots[topk_ids, choice]
