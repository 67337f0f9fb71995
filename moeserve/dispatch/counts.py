"""Counting pairs per expert on the device, shared by the backends."""

from __future__ import annotations

import torch


def count_per_expert(ids: torch.Tensor, num_experts: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """int64 `[num_experts]`: how often each id in [0, num_experts) occurs in `ids`, or, with
    int64 `weights` of ids' shape, the sum of the weights of its occurrences.

    A scatter-add of static size: `torch.bincount` reads the largest id back to size its output.
    """
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat) if weights is None else weights.reshape(-1))
