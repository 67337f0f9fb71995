"""The projections of attention and of the dense MLPs, computed by the ops backend.

Through the backend rather than `F.linear` on `self.weight`, so that an FP8 weight reaches it as
stored (`models.fp8.stored_weight`): the torch path dequantizes it, the Triton path runs a w8a8
GEMM on its bytes and scales, and neither pays for the other's form.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.models.fp8 import stored_weight
from moeserve.ops import TORCH_OPS, LayerOps


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose product is `ops.linear`'s."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__(in_dim, out_dim, bias=bias, dtype=dtype, device=device)
        self.requires_grad_(False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, stored_weight(self, "weight"), self.bias)
