"""DeepSeek's multi-token prediction (MTP) layer, as DeepSeek-V3 and GLM-4.5 ship it: the module
that predicts the token after next from the target's hidden state and the next token.

Checkpoints store MTP layer i as decoder layer `num_hidden_layers + i`: its own `embed_tokens`,
`enorm` (of the next token's embedding), `hnorm` (of the target's hidden state), `eh_proj`
`[H, 2H]` over their concatenation (embedding first), a full decoder layer (attention + MoE), and
`shared_head.norm` / `shared_head.head` giving its logits.

The hidden state it reads is the target's output after its final norm, as the releases' own
modeling code hands it over (the main model's forward ends in `model.norm`, and that tensor is
the MTP's `previous_hidden_states`): `hnorm` was trained on it. The stream before the norm is not
the same input up to a scale: `hnorm(norm(x))` differs from `hnorm(x)` by the final norm's
per-channel weights, so reading it costs acceptance (never correctness: the target verifies
every draft). A later draft reads this layer's own output after `shared_head.norm`, as vLLM and
SGLang recycle it.

Qwen3-Next's and Qwen3.5's MTP layer is the same computation under other names (`fc` for
`eh_proj`, `pre_fc_norm_embedding` / `pre_fc_norm_hidden`, `norm` before the target's own head,
over the target's embedding), reading the same inputs.
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
        """hidden `[T, H]` (the target's final hidden state at each row's position), next_ids `[T]`
        (the token after each row) -> (what the next draft position reads as its hidden state, and
        what `logits` reads), `[T, H]` each: both this layer's output after `head_norm` (the
        drafter's interface keeps them apart for DeepSeek-V4's MTP, whose two differ)."""
        embedded = self.enorm(F.embedding(next_ids, self.embed_tokens))
        x = F.linear(torch.cat((embedded, self.hnorm(hidden)), -1), self.eh_proj)
        x, residual = self.layer(x, None, cos, sin, kv_cache, plan, None)
        normed, _ = self.head_norm.add(x, residual)
        normed = self.tp.all_gather_tokens(normed, next_ids.shape[0])
        return normed, normed

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed `[S, H]` -> logits `[S, V]` float32 (the draft takes their argmax)."""
        return F.linear(normed, self.head).float()
