"""The gated activation between an expert's (or a dense MLP's) two projections, in torch: the
model's CPU path computes it, and the Triton kernels' references check their epilogues against
it (`kernels/activation.py`). A module of its own so that both rooms read it without one
importing the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.config import GatedActivation


def gated(gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation | None) -> torch.Tensor:
    """The down projection's input from the gate and up projections (`GatedActivation`), in
    transformers' order of operations."""
    if activation is None or activation.kind == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=activation.limit)
    up = up.clamp(-activation.limit, activation.limit)
    if activation.kind == "clamped_silu":
        return F.silu(gate) * up
    return (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))
