"""DeepSeek's multi-token prediction (MTP) layer, as DeepSeek-V3 and GLM-4.5 ship it: the module
that predicts the token after next from the target's hidden state and the next token.

Checkpoints store MTP layer i as decoder layer `num_hidden_layers + i`: its own `embed_tokens`,
`enorm` (of the next token's embedding), `hnorm` (of the target's hidden state), `eh_proj`
`[H, 2H]` over their concatenation (embedding first), a full decoder layer (attention + MoE), and
`shared_head.norm` / `shared_head.head` giving its logits.

The hidden state it reads is the target's residual stream after the last decoder layer, before
the final norm: the DeepSeek-V3 report's "representation of the main model" feeds `hnorm`, which
normalises it again anyway (the final norm's scale aside, the two inputs differ only by it).

Qwen3-Next's and Qwen3.5's MTP layer is the same computation under other names (`fc` for
`eh_proj`, `pre_fc_norm_embedding` / `pre_fc_norm_hidden`, `norm` before the target's own head,
over the target's embedding) reading the target's hidden states after its final norm
(`ModelConfig.mtp_reads_normed`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.models.layers.moe import MoEBlock
from moeserve.models.layers.norm import RMSNorm
from moeserve.models.tensor_parallel import SINGLE, TensorParallel
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.attention import AttentionPlan


class MTPLayer(nn.Module):
    """One MTP layer around `layer`, a decoder layer built like the target's last MoE layer (MTP
    layers are MoE layers with full attention in every release), so its MoE dispatches through the
    target's dispatcher and its attention uses a KV cache of the target's layout."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: nn.Module,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.tp = tp
        self.reads_normed = cfg.mtp_reads_normed
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, hidden, dtype=dtype, device=device), False)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device, ops)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device, ops)
        self.eh_proj = nn.Parameter(torch.empty(hidden, 2 * hidden, dtype=dtype, device=device), False)
        self.layer = layer
        self.head_norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device, ops)
        self.head = nn.Parameter(torch.empty(cfg.vocab_size, hidden, dtype=dtype, device=device), False)

    @property
    def moe(self) -> MoEBlock:
        return self.layer.mlp

    def forward(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden `[T, H]` (the stream before the final norm at each row's position), next_ids `[T]`
        (the token after each row) -> (this layer's stream `[T, H]`, which the next draft position
        reads as its hidden state (its normed output where the config says `mtp_reads_normed`), and
        its normed output `[T, H]`, which `logits` reads)."""
        num_tokens = next_ids.shape[0]
        embedded = self.enorm(F.embedding(next_ids, self.embed_tokens))
        x = F.linear(torch.cat((embedded, self.hnorm(hidden)), -1), self.eh_proj)
        x, residual = self.layer(x, None, cos, sin, kv_cache, plan, None)
        normed, stream = self.head_norm.add(x, residual)
        if self.reads_normed:
            stream = normed
        return self.tp.all_gather_tokens(stream, num_tokens), self.tp.all_gather_tokens(normed, num_tokens)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed `[S, H]` -> logits `[S, V]` float32 (the draft takes their argmax)."""
        return F.linear(normed, self.head).float()
