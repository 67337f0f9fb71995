"""What a model's dispatches move per token, known from its config before the first step.

A backend that lays out memory for these rows (the `nvshmem` backend's symmetric buffer) takes
them at construction and allocates there, at startup, where every rank builds its dispatcher
collectively and in the same order. Allocating inside the first dispatch instead let a fast peer
store rows into a slow rank's buffer before that rank's zero-fill had run, wiping them (a hang
at the first MoE layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchRows:
    """hidden_size: channels of a dispatched row (the MoE block's input, never split by TP).
    top_k: experts each token picks, so the rows combine brings back per token.
    dtype: the activations' dtype: dispatched rows (before any FP8 packing) and combined rows."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("hidden_size", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dispatched rows are activations, not {self.dtype}")
