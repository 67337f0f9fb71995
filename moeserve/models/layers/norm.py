"""RMSNorm with the reference implementations' numerics (see `LayerOps.rms_norm`)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.models.tensor_parallel import SINGLE, Shard, TensorParallel, mark_shard
from moeserve.ops import TORCH_OPS, LayerOps


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str = "cpu", ops: LayerOps = TORCH_OPS
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: the residual add before the norm, fused where the
        backend can (`LayerOps.add_rms_norm`)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class ProjectionNorm(nn.Module):
    """RMSNorm over a whole q or k projection, all heads together (OLMoE, MiniMax-M2).

    Under tensor parallelism a rank holds `columns` of the `full` ones (its heads, from column
    `start`), and `replicas` ranks hold each of them (KV heads replicated over more ranks than
    there are heads): the mean square is the group's sum of each rank's sum of squares, divided
    by the replicas and by `full`, so every rank normalises by the whole projection's RMS. On one
    rank it is `LayerOps.rms_norm` itself.
    """

    def __init__(
        self,
        columns: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
        tp: TensorParallel = SINGLE,
        start: int = 0,
        full: int | None = None,
        replicas: int = 1,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(columns, dtype=dtype, device=device), requires_grad=False)
        self.tp = tp
        self.full = columns if full is None else full
        self.replicas = replicas
        if tp.size > 1:
            mark_shard(self.weight, Shard(0, start, columns, self.full))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, columns]` -> normalised `[T, columns]`, in x's dtype."""
        if self.tp.size == 1:
            return self.ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        sum_squares = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas  # [T, 1]
        return self.weight * (x32 * torch.rsqrt(sum_squares / self.full + self.eps)).to(x.dtype)
