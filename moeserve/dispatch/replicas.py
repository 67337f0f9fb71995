"""Logical expert ids -> physical slots, on the device, before the all-to-all.

Round robin per expert: the i-th of a rank's pairs (in token, k order) that picked logical expert
e goes to replica `(i + rank) mod n_e` of e's `n_e` slots. Deterministic, no communication, and
each rank's pairs for a hot expert split over its replicas within one of each other (the
`+ rank` keeps every rank's first pair off the same replica). Spreading by token index instead
splits unevenly when a rank has few tokens (decode), which measurably unbalanced the ranks.
Which replica serves a pair does not change its result: the
replicas hold the same weights, and combine sums each token's k rows in logical-id order
(`DispatchHandle.sum_order`).
"""

from __future__ import annotations

import torch

from moeserve.dispatch.counts import count_per_expert


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
        flat = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, each group in pair order
        per_expert = count_per_expert(flat, self.count.shape[0])
        first = torch.cumsum(per_expert, 0) - per_expert  # [E]: each group's start in `order`
        nth = torch.empty_like(flat)
        nth[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]  # [T*K]
        choice = (nth + self.rank) % self.count[flat]
        return self.slots[flat, choice].view_as(topk_ids)
