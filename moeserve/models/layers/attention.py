"""Grouped-query attention over the paged KV cache (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.models.layers.norm import RMSNorm
from moeserve.models.tensor_parallel import SINGLE, TensorParallel, column_parallel, kv_heads_of, row_parallel
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.attention import AttentionPlan, write_to_cache


def linear(in_dim: int, out_dim: int, bias: bool, dtype: torch.dtype, device: torch.device | str) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim, bias=bias, dtype=dtype, device=device)
    layer.requires_grad_(False)
    return layer


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
        self.q_proj = column_parallel(
            linear(h, q_cols, cfg.qkv_bias, dtype, device), tp.rank * q_cols, cfg.num_heads * d, tp
        )
        self.k_proj = column_parallel(
            linear(h, kv_cols, cfg.qkv_bias, dtype, device), first_kv * d, cfg.num_kv_heads * d, tp
        )
        self.v_proj = column_parallel(
            linear(h, kv_cols, cfg.qkv_bias, dtype, device), first_kv * d, cfg.num_kv_heads * d, tp
        )
        self.o_proj = row_parallel(
            linear(q_cols, h, cfg.o_bias, dtype, device), tp.rank * q_cols, cfg.num_heads * d, tp
        )
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device, ops) if cfg.qk_norm else None

    @staticmethod
    def cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
        return (2, num_blocks, block_size, kv_heads_of(cfg.num_kv_heads, 0, tp_size)[1], cfg.head_dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """x `[T, H]`; cos/sin `[T, D]` -> `[T, H]` (this rank's partial sum under TP)."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary_qk(q, k, cos, sin, self.interleaved_rope)  # q and k are ours: may rotate in place
        write_to_cache(kv_cache[0], k, plan.slot_mapping)
        write_to_cache(kv_cache[1], v, plan.slot_mapping)
        out = self.ops.paged_attention(q, kv_cache[0], kv_cache[1], plan, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, out.shape[1] * out.shape[2]))  # explicit: T may be 0
