"""The experts' gated MLP over rows grouped by expert, in plain torch and without host syncs.

`torch.nn.functional.grouped_mm` takes the group boundaries as a device tensor of offsets, so
one call covers every expert whatever the counts, and nothing is read back to size a loop.
Rows past the last offset (padding a dispatcher left at the end) are not computed: their
output is unspecified.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_grouped_mm = getattr(F, "grouped_mm", None)  # public since torch 2.9; older releases lack it


def row_experts(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 `[num_rows]`: the expert of each row of an expert-major batch with `counts[e]` rows
    per expert; rows past `sum(counts)` (padding) get `len(counts)`, an id no expert has."""
    ends = torch.cumsum(counts, 0)
    return torch.searchsorted(ends, torch.arange(num_rows, device=counts.device), right=True)


def grouped_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x `[N, H]` grouped by expert (`counts` int64 `[E]` rows each, then padding) -> `[N, H]`.

    w13 `[E, 2I, H]` (gate rows then up rows), w2 `[E, H, I]`: `silu(x gate^T) * (x up^T) w2^T`.
    """
    if _grouped_mm is None:
        return masked_mlp(x, counts, w13, w2)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = _grouped_mm(x, w13.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    return _grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)


def masked_mlp(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """`grouped_mlp` for a torch without `grouped_mm`: every expert over every row, each row keeping
    its own expert's result. E times the FLOPs, but still no host sync and one read of each
    expert's weights, which is what bounds decode; padding rows come out as zeros."""
    expert = row_experts(counts, x.shape[0])
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        out = torch.where((expert == e)[:, None], F.linear(F.silu(gate) * up, w2[e]), out)
    return out
