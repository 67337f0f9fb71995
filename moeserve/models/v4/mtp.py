"""DeepSeek-V4's multi-token prediction (MTP) block, as its release ships it (`mtp.0.`): what
predicts the token after next from the target's hyper-connection streams and the next token.

Each of the target's streams at position p (before its hyper head) becomes
`e_proj(enorm(embed(token p + 1))) + h_proj(hnorm(stream))`; a full V4 block (attention over its
own sliding window, learned-routed MoE, each between its hyper-connections) follows, then the
block's own hyper head and norm, and the target's head gives its logits. The embedding and head
are the target's (the release stores none of its own). A later draft reads the block's output
streams as the target's.

The block's attention is window-only (the release's `compress_ratios` ends with a 0 for it), so
its cache is one more window in the decoder's window group. Its row for position p is row p + 1,
the position of the token it embeds: a query then reads the same rows as the target's query at
p + 1, which the scheduler's window keeps, and rotary attention, which sees relative positions
only, computes what it computes at p.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.models.layers.linear import Linear
from moeserve.models.v4.cache import LayerCache, V4Batch
from moeserve.models.v4.hyper import HyperHead
from moeserve.models.v4.norm import Float32RMSNorm
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.host_ints import int64_tensor


class V4MTPBlock(nn.Module):
    """An MTP block around `layer`: the model's decoder layer `num_layers + index` for MTP block
    `index` (window-only attention, learned routing), dispatching through the target's dispatcher."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: nn.Module,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        hc = cfg.hyper_connections
        assert hc is not None
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = Float32RMSNorm(h, eps, device)
        self.hnorm = Float32RMSNorm(h, eps, device)
        self.e_proj = Linear(h, h, False, dtype, device, ops)
        self.h_proj = Linear(h, h, False, dtype, device, ops)
        self.layer = layer
        self.hc_head = HyperHead(hc, h, eps, device)
        self.norm = Float32RMSNorm(h, eps, device)

    def forward(
        self,
        next_ids: torch.Tensor,
        embed: torch.Tensor,
        streams: torch.Tensor,
        rows: V4Batch,
        cache: LayerCache,
        max_tokens_per_rank: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """next_ids `[R]` (the token after each row), embed (the target's embedding), streams `[R, N, H]`
        (the target's, or a previous draft's), `rows`: each sequence's rows in turn, its view
        starting at its first row's cache row -> (the block's output streams `[S, N, H]` and its
        normed output `[S, H]`, for each sequence's last row). The rows before a sequence's last
        only write their window keys: nothing reads their outputs."""
        x = self.e_proj(self.enorm(F.embedding(next_ids, embed))).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        ends = list(itertools.accumulate(rows.query_lens))
        for seq, n, end in zip(rows.sequences, rows.query_lens, ends, strict=True):
            if n > 1:
                _, _, collapsed = self.layer.attn_hc(x[end - n : end - 1])
                self.layer.attn.write_keys(self.layer.input_norm(collapsed), cache, seq)
        last = int64_tensor([end - 1 for end in ends]).to(x.device)
        lasts = V4Batch(
            (1,) * len(ends),
            tuple(replace(seq, start=seq.start + n - 1) for seq, n in zip(rows.sequences, rows.query_lens)),
        )
        out = self.layer(x[last], next_ids[last], lasts, cache, max_tokens_per_rank)
        return out, self.norm(self.hc_head(out))
