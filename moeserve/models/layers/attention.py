"""Grouped-query attention over the paged KV cache (every architecture but DeepSeek's MLA).

Options, each a `ModelConfig` field: q/k/v and o biases; an RMSNorm of q and k per head
(Qwen3, GLM-4.5) or over the whole projection (OLMoE, MiniMax-M2); OLMoE's clamp of q, k, v;
rotary over only the first `rope.rotary_dim` dims of each head (GLM-4.5, MiniMax-M2); a sliding
window per layer; gpt-oss's per-head attention sinks; Qwen3-Next's and Qwen3.5's output gate
(q_proj gives each head's query then its gate; the output is scaled by sigmoid(gate)).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.cache_spec import PagedSpec
from moeserve.config import ModelConfig
from moeserve.engine_config import dtype_name
from moeserve.models.layers.linear import Linear
from moeserve.models.layers.norm import ProjectionNorm, RMSNorm
from moeserve.models.tensor_parallel import (
    SINGLE,
    Shard,
    TensorParallel,
    column_parallel,
    kv_heads_of,
    mark_shard,
    row_parallel,
)
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.attention import AttentionPlan, write_to_cache


class Attention(nn.Module):
    """KV cache layout for this layer: `[2, num_blocks, block_size, Hkv, D]` (K then V), with
    this rank's KV heads only under tensor parallelism.

    Tensor parallel: q/k/v hold this rank's heads (column-parallel), o_proj their input columns
    (row-parallel), so forward() returns this rank's partial sum of the output.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        first_kv, self.num_kv_heads = kv_heads_of(cfg.num_kv_heads, tp.rank, tp.size)
        self.head_dim = d
        self.scale = cfg.attention_scale or d**-0.5
        self.sliding_window = cfg.sliding_windows[layer]
        self.interleaved_rope = cfg.rope.interleaved
        q_cols, kv_cols = self.num_heads * d, self.num_kv_heads * d
        self.output_gate = cfg.attention_output_gate
        per_head = 2 if self.output_gate else 1
        self.q_proj = column_parallel(
            Linear(h, per_head * q_cols, cfg.qkv_bias, dtype, device, ops),
            tp.rank * per_head * q_cols,
            per_head * cfg.num_heads * d,
            tp,
        )
        self.k_proj = column_parallel(
            Linear(h, kv_cols, cfg.qkv_bias, dtype, device, ops), first_kv * d, cfg.num_kv_heads * d, tp
        )
        self.v_proj = column_parallel(
            Linear(h, kv_cols, cfg.qkv_bias, dtype, device, ops), first_kv * d, cfg.num_kv_heads * d, tp
        )
        self.o_proj = row_parallel(
            Linear(q_cols, h, cfg.o_bias, dtype, device, ops), tp.rank * q_cols, cfg.num_heads * d, tp
        )
        self.rotary_dim = cfg.rope.rotary_dim
        self.clip_qkv = cfg.clip_qkv
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ops)
        elif cfg.qk_norm == "full":
            kv_replicas = max(1, tp.size // cfg.num_kv_heads)
            self.q_norm = ProjectionNorm(
                q_cols, cfg.rms_norm_eps, dtype, device, ops, tp, tp.rank * q_cols, cfg.num_heads * d
            )
            self.k_norm = ProjectionNorm(
                kv_cols, cfg.rms_norm_eps, dtype, device, ops, tp, first_kv * d, cfg.num_kv_heads * d, kv_replicas
            )
        self.sinks = None
        if cfg.attention_sinks:  # one logit per query head, this rank's heads under TP
            self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype, device=device), requires_grad=False)
            if tp.size > 1:
                mark_shard(self.sinks, Shard(0, tp.rank * self.num_heads, self.num_heads, cfg.num_heads))

    @staticmethod
    def cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
        return Attention.cache_spec(cfg, torch.float32, tp_size).shape(num_blocks, block_size)

    @staticmethod
    def cache_spec(cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> PagedSpec:
        """K then V of this rank's KV heads, per token."""
        return PagedSpec((2,), (kv_heads_of(cfg.num_kv_heads, 0, tp_size)[1], cfg.head_dim), dtype_name(dtype))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """x `[T, H]`; cos/sin `[T, D]` -> `[T, H]` (this rank's partial sum under TP)."""
        num_tokens = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [T, Hq * D], [T, Hkv * D] x2
        gate = None
        if self.output_gate:  # each head's D query columns, then its D gate columns
            q, gate = q.view(num_tokens, self.num_heads, 2, self.head_dim).unbind(2)
            cols = self.num_heads * self.head_dim  # explicit: T may be 0
            q, gate = q.reshape(num_tokens, cols), gate.reshape(num_tokens, cols)
        if isinstance(self.q_norm, ProjectionNorm):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if isinstance(self.q_norm, RMSNorm):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, k, cos, sin)
        write_to_cache(kv_cache[0], k, plan.slot_mapping)
        write_to_cache(kv_cache[1], v, plan.slot_mapping)
        out = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], plan, self.scale, self.sliding_window, self.sinks)
        out = out.reshape(num_tokens, out.shape[1] * out.shape[2])  # explicit: T may be 0
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary over each head's first `rotary_dim` dims (all of them for most models); q and
        k are ours, so a backend may rotate them in place."""
        if self.rotary_dim == self.head_dim:
            return self.ops.rotary_qk(q, k, cos, sin, self.interleaved_rope)
        r = self.rotary_dim
        q_rot, k_rot = self.ops.rotary_qk(q[..., :r], k[..., :r], cos, sin, self.interleaved_rope)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
