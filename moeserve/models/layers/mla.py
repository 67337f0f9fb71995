"""DeepSeek multi-head latent attention (MLA) over a paged cache of compressed latents.

The cache holds, per token, the normalised KV latent `[kv_lora_rank]` and the already-rotated
shared rope key `[qk_rope_head_dim]`: (512 + 64) values per token for DeepSeek-V3 instead of
128 heads x (192 + 128) for full K/V. Attention expands the context latents through kv_b_proj
(the torch reference, `TorchOps.mla_attention`); the Triton backend absorbs kv_b_proj into the
query and output instead and attends over the latents themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.cache_spec import PagedSpec
from moeserve.config import ModelConfig
from moeserve.engine_config import dtype_name
from moeserve.fp8_format import BlockFP8Weight
from moeserve.models.fp8 import stored_weight
from moeserve.models.layers.linear import Linear
from moeserve.models.layers.norm import RMSNorm
from moeserve.models.tensor_parallel import SINGLE, TensorParallel, column_parallel, row_parallel
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.attention import AttentionPlan, write_to_cache


class MLAttention(nn.Module):
    """KV cache layout for this layer: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`.

    Tensor parallel: the per-head projections (q / q_b, kv_b) hold this rank's heads and o_proj
    their input columns; the latent projections and the latent cache are replicated, which is
    why DeepSeek deployments prefer data-parallel attention (`--tp 1`) for MLA.
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
        assert cfg.mla is not None
        self.ops = ops
        m, h = cfg.mla, cfg.hidden_size
        self.mla = m
        self.num_heads = heads = tp.split(cfg.num_heads, "num_attention_heads")
        first = tp.rank * heads
        self.scale = cfg.attention_scale or m.qk_head_dim**-0.5
        self.interleaved_rope = cfg.rope.interleaved
        q_out = heads * m.qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = column_parallel(
                Linear(h, q_out, False, dtype, device, ops), first * m.qk_head_dim, cfg.num_heads * m.qk_head_dim, tp
            )
        else:
            self.q_a_proj = Linear(h, m.q_lora_rank, cfg.qkv_bias, dtype, device, ops)
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, dtype, device, ops)
            self.q_b_proj = column_parallel(
                Linear(m.q_lora_rank, q_out, False, dtype, device, ops),
                first * m.qk_head_dim,
                cfg.num_heads * m.qk_head_dim,
                tp,
            )
        self.kv_a_proj = Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, cfg.qkv_bias, dtype, device, ops)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, dtype, device, ops)
        kv_per_head = m.qk_nope_head_dim + m.v_head_dim
        self.kv_b_proj = column_parallel(
            Linear(m.kv_lora_rank, heads * kv_per_head, False, dtype, device, ops),
            first * kv_per_head,
            cfg.num_heads * kv_per_head,
            tp,
        )
        self.o_proj = row_parallel(
            Linear(heads * m.v_head_dim, h, cfg.o_bias, dtype, device, ops),
            first * m.v_head_dim,
            cfg.num_heads * m.v_head_dim,
            tp,
        )
        self._kv_b_values: torch.Tensor | None = None  # a quantized kv_b_proj's values, once read

    def kv_b_matrix(self) -> torch.Tensor:
        """kv_b_proj's values, which the backends use as a matrix (to expand the latents, or to
        absorb into q and the output). An FP8 kv_b_proj is dequantized on its first read and the
        values kept, as vLLM keeps them: read through its parametrization, every forward of every
        layer would dequantize all of it again (DeepSeek-V3: 16.8M values a layer, 2 GiB of bf16
        writes a step over its 61 layers), for 34 MB of bf16 a layer held. The weight is not
        written after the load: rebalances and heals move experts only. `stored_weight` tells FP8
        apart without `parametrize.is_parametrized`'s caught AttributeError on every forward."""
        if self._kv_b_values is not None:
            return self._kv_b_values
        if not isinstance(stored_weight(self.kv_b_proj, "weight"), BlockFP8Weight):
            return self.kv_b_proj.weight
        self._kv_b_values = self.kv_b_proj.weight
        return self._kv_b_values

    @staticmethod
    def cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
        return MLAttention.cache_spec(cfg, torch.float32, tp_size).shape(num_blocks, block_size)

    @staticmethod
    def cache_spec(cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> PagedSpec:
        """The latent and the rotary key, per token, shared by every head (the same on every TP rank)."""
        assert cfg.mla is not None
        return PagedSpec((), (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim,), dtype_name(dtype))

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> the queries `[T, Hq, nope + rope]`, and the normed query latent (None without one)."""
        if self.mla.q_lora_rank is None:
            q, latent = self.q_proj(x), None
        else:
            latent = self.q_a_norm(self.q_a_proj(x))
            q = self.q_b_proj(latent)
        return q.view(x.shape[0], self.num_heads, self.mla.qk_head_dim), latent

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's latents written to `kv_cache`; -> (q_nope, rotated q_rope, the query latent)."""
        m = self.mla
        q, q_latent = self._queries(x)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv_nope, k_rope = self.kv_a_proj(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        # Views into q and kv_a_proj's output, which are ours: a backend may rotate them in place.
        q_rope, k_rope = self.ops.rotary_qk(q_rope, k_rope[:, None, :], cos, sin, self.interleaved_rope)
        write_to_cache(kv_cache, torch.cat((self.kv_a_norm(kv_nope), k_rope[:, 0]), dim=-1), plan.slot_mapping)
        return q_nope, q_rope, q_latent

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs `[T, Hq, v]` through o_proj -> `[T, H]`."""
        return self.o_proj(out.reshape(out.shape[0], out.shape[1] * out.shape[2]))  # explicit: T may be 0

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """x `[T, H]`; cos/sin `[T, rope]` -> `[T, H]`."""
        q_nope, q_rope, _ = self._project(x, cos, sin, kv_cache, plan)
        return self._output(
            self.ops.mla_attention(q_nope, q_rope, kv_cache, plan, self.kv_b_matrix(), self.mla, self.scale)
        )
