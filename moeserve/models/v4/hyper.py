"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual is `mult` streams.

Around each block a small projection of the flattened, normalised streams gives three weights:
`pre` collapses the streams into the block's input, `post` spreads the block's output back over
the streams, and `comb`, projected onto the doubly-stochastic matrices by Sinkhorn iterations so
that mixing never grows the stream's norm, mixes the streams that carry on. The hyper head
collapses them once more before the final norm. Everything is computed in float32, as the
reference keeps these modules in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import HyperConnectionConfig
from moeserve.models.v4.norm import unweighted_rms_norm


def _projection(
    rows: int, columns: int, scales: int, device: torch.device | str
) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """A mixer's float32 weights: the projection `[rows, columns]`, its bias and its scales."""
    return tuple(  # type: ignore[return-value]
        nn.Parameter(torch.empty(shape, device=device), requires_grad=False)
        for shape in ((rows, columns), (rows,), (scales,))
    )


def _mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """streams `[T, N, H]` flattened, normalised and projected in float32 -> `[T, rows]`."""
    return F.linear(unweighted_rms_norm(streams.flatten(1).float(), norm_eps), fn.float())


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Softmax over rows, then alternating column / row normalisation: `iters` column passes and
    `iters - 1` row passes, the reference's order (it ends on columns)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mHC: streams `[T, N, H]` -> (post `[T, N]`, comb `[T, N, N]`, the block's input `[T, H]`)."""

    def __init__(
        self, cfg: HyperConnectionConfig, hidden: int, norm_eps: float, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.cfg, self.norm_eps = cfg, norm_eps
        self.fn, self.base, self.scale = _projection((2 + cfg.mult) * cfg.mult, cfg.mult * hidden, 3, device)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.cfg.mult
        mixes = _mixes(streams, self.fn, self.norm_eps)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.cfg.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = sinkhorn((comb_w * comb_s).view(-1, n, n) + comb_b.view(n, n), self.cfg.sinkhorn_iters, self.cfg.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: its output `[T, H]` spread by post, plus the streams `[T, N, H]`
    mixed by comb (summed over comb's first axis: comb is not symmetric)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


class HyperHead(nn.Module):
    """The final collapse of the streams `[T, N, H]` -> `[T, H]`, before the model's norm."""

    def __init__(
        self, cfg: HyperConnectionConfig, hidden: int, norm_eps: float, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.cfg, self.norm_eps = cfg, norm_eps
        self.hc_fn, self.hc_base, self.hc_scale = _projection(cfg.mult, cfg.mult * hidden, 1, device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = _mixes(streams, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.cfg.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
