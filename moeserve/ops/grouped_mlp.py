"""The experts' gated MLP over rows grouped by expert, in plain torch and without host syncs.

`torch.nn.functional.grouped_mm` takes the group boundaries as a device tensor of offsets, so
one call covers every expert whatever the counts, and nothing is read back to size a loop.
Rows past the last offset (padding a dispatcher left at the end) are not computed: their
output is unspecified.

`grouped_mm` reads its matrices as TMA does: every row stride a multiple of 16 bytes. A hidden
size or expert width that is not (28 bf16 values are 56 bytes) is zero-padded up to one for the
call: a zero column adds exactly nothing to a dot product, gated(0, 0) is 0 for both
activations, and the padded outputs are cut off. Published models' widths are multiples of 64,
so the copies this costs are met only by odd configurations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.config import GatedActivation
from moeserve.gated_activation import gated

_grouped_mm = getattr(F, "grouped_mm", None)  # public since torch 2.9; older releases lack it
_STRIDE_BYTES = 16  # what `grouped_mm` needs each row stride to be a multiple of


def row_experts(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 `[num_rows]`: the expert of each row of an expert-major batch with `counts[e]` rows
    per expert; rows past `sum(counts)` (padding) get `len(counts)`, an id no expert has."""
    ends = torch.cumsum(counts, 0)
    return torch.searchsorted(ends, torch.arange(num_rows, device=counts.device), right=True)


def grouped_mlp(
    x: torch.Tensor,
    counts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """x `[N, H]` grouped by expert (`counts` int64 `[E]` rows each, then padding) -> `[N, H]`.

    w13 `[E, 2I, H]` (gate rows then up rows), w2 `[E, H, I]`, optional biases b13 `[E, 2I]`,
    b2 `[E, H]`: `act(x gate^T + b_gate, x up^T + b_up) w2^T + b2` (act: `gated`).
    """
    if _grouped_mm is None:
        return masked_mlp(x, counts, w13, w2, b13, b2, activation)
    hidden, width = w2.shape[1:]
    align = _STRIDE_BYTES // x.element_size()
    padded_hidden, padded_width = -(-hidden // align) * align, -(-width // align) * align
    x, w13 = _zero_pad(x, -1, padded_hidden), _zero_pad(w13, -1, padded_hidden)
    w2 = _zero_pad(_zero_pad(w2, 1, padded_hidden), 2, padded_width)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    # Each row's expert, for the biases; padding rows borrow the last expert's (their output is unspecified).
    expert = None if b13 is None and b2 is None else row_experts(counts, x.shape[0]).clamp_(max=w13.shape[0] - 1)
    gate_up = _grouped_mm(x, w13.transpose(1, 2), offs=offsets)  # [N, 2I]
    if b13 is not None:
        gate_up = gate_up + b13.index_select(0, expert)
    gate, up = gate_up.chunk(2, dim=-1)
    h = _zero_pad(gated(gate, up, activation), -1, padded_width)
    out = _grouped_mm(h, w2.transpose(1, 2), offs=offsets)[:, :hidden].contiguous()  # [N, H]
    return out if b2 is None else out + b2.index_select(0, expert)


def _zero_pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `size` (`t` itself when it is that size)."""
    extra = size - t.shape[dim]
    if not extra:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 1 - dim % t.dim()) + (0, extra))


def masked_mlp(
    x: torch.Tensor,
    counts: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """`grouped_mlp` for a torch without `grouped_mm`: every expert over every row, each row keeping
    its own expert's result. E times the FLOPs, but still no host sync and one read of each
    expert's weights, which is what bounds decode; padding rows come out as zeros."""
    expert = row_experts(counts, x.shape[0])
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = F.linear(x, w13[e], None if b13 is None else b13[e]).chunk(2, dim=-1)
        y = F.linear(gated(gate, up, activation), w2[e], None if b2 is None else b2[e])
        out = torch.where((expert == e)[:, None], y, out)
    return out
