"""Rotary position embedding applied to queries and keys: the torch reference of every backend."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x `[T, heads, rotary_dim]` by cos/sin `[T, rotary_dim]`."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        # Pairs (x0, x1), (x2, x3)... rotate by one frequency each; output is de-interleaved
        # (evens then odds), which is what the reference does and what the keys get too.
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
