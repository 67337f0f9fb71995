"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA over the positions a lightning indexer
chooses for each query.

The indexer has its own heads: queries from MLA's query latent (`wq_b`), one key per token from
the hidden state (`wk`, then a LayerNorm), both rotated on their first `qk_rope_head_dim` dims,
and per-head weights from the hidden state (`weights_proj`, float32 as transformers keeps it).
Its keys are a second paged cache beside the latent, one entry per token in the same blocks
(`cache_spec`), so prefix caching shares them with the latent: in the compute dtype, or with
`DSAConfig.fp8_keys` as DeepSeek-V3.2's release caches them, e4m3 with a float32 scale per token
(`ops.sparse_mla.fp8_key_rows`; the scoring dequantizes what it gathers). The backend chooses and attends
(`LayerOps.dsa_select`, `sparse_mla_attention`): `ops.sparse_mla` is the reference, the Triton
backend runs `kernels.sparse_mla`.

Tensor parallel: the indexer is replicated, as the latent projections are: every rank of a group
chooses the same positions for its own heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moeserve.cache_spec import PagedSpec
from moeserve.config import ModelConfig
from moeserve.engine_config import dtype_name
from moeserve.models.layers.linear import Linear
from moeserve.models.layers.mla import MLAttention
from moeserve.models.tensor_parallel import SINGLE, TensorParallel
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.attention import AttentionPlan, write_to_cache
from moeserve.ops.sparse_mla import fp8_key_row_bytes, fp8_key_rows

INDEXER_NORM_EPS = 1e-6  # the indexer's k_norm, as DeepSeek's code and transformers fix it


class Indexer(nn.Module):
    """Scores every visible key of each query and keeps the `index_topk` best (`indexer_topk`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, ops: LayerOps) -> None:
        super().__init__()
        assert cfg.dsa is not None and cfg.mla is not None and cfg.mla.q_lora_rank is not None
        d = self.dsa = cfg.dsa
        self.rope_dim = cfg.mla.qk_rope_head_dim
        self.ops = ops
        self.wq_b = Linear(cfg.mla.q_lora_rank, d.index_n_heads * d.index_head_dim, False, dtype, device, ops)
        self.wk = Linear(cfg.hidden_size, d.index_head_dim, False, dtype, device, ops)
        self.k_norm = nn.LayerNorm(d.index_head_dim, INDEXER_NORM_EPS, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(cfg.hidden_size, d.index_n_heads, False, torch.float32, device, ops)

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> Any:
        """x `[T, H]`, q_latent `[T, q_lora_rank]`: the step's keys written to `key_cache`, then each
        query's choice."""
        d, num_tokens = self.dsa, x.shape[0]
        q = self.wq_b(q_latent).view(num_tokens, d.index_n_heads, d.index_head_dim)
        k = self.k_norm(self.wk(x))[:, None, :]  # [T, 1, Di]
        q_rot, k_rot = self.ops.rotary_qk(
            q[..., : self.rope_dim].contiguous(), k[..., : self.rope_dim].contiguous(), cos, sin, d.interleaved_rope
        )
        q = torch.cat((q_rot, q[..., self.rope_dim :]), dim=-1)
        k = torch.cat((k_rot, k[..., self.rope_dim :]), dim=-1)[:, 0]
        write_to_cache(key_cache, fp8_key_rows(k) if d.fp8_keys else k, plan.slot_mapping)
        weights = self.weights_proj(x.float()) * d.index_n_heads**-0.5  # [T, Hi] float32
        return self.ops.dsa_select(q, weights, key_cache, plan, d.index_topk)


class SparseMLAttention(MLAttention):
    """MLA over the indexer's choice. A layer with an indexer keeps `(latent, indexer keys)` as
    its cache; a GLM-5 layer without one keeps the latent only and attends with the choice of
    the last layer before it that has one (the plan carries it, `AttentionPlan.selections`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__(cfg, layer, dtype, device, tp, ops)
        assert cfg.dsa is not None
        self.source = cfg.dsa.source_layer(layer)
        self.indexer = Indexer(cfg, dtype, device, ops) if self.source == layer else None

    @staticmethod
    def layer_cache_spec(
        cfg: ModelConfig, layer: int, dtype: torch.dtype, tp_size: int = 1
    ) -> PagedSpec | tuple[PagedSpec, ...]:
        """The latent (`MLAttention.cache_spec`), and for a layer with an indexer its keys: one
        `index_head_dim` entry per token, in the model's dtype as transformers caches them, or
        with `fp8_keys` one row of `index_head_dim + 4` bytes (e4m3 bytes, then the float32 scale)."""
        latent = MLAttention.cache_spec(cfg, dtype, tp_size)
        assert cfg.dsa is not None
        if not cfg.dsa.has_indexer(layer):
            return latent
        if cfg.dsa.fp8_keys:
            return latent, PagedSpec((), (fp8_key_row_bytes(cfg.dsa.index_head_dim),), "uint8")
        return latent, PagedSpec((), (cfg.dsa.index_head_dim,), dtype_name(dtype))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """x `[T, H]`; cos/sin `[T, rope]` -> `[T, H]`."""
        latent_cache = kv_cache[0] if self.indexer is not None else kv_cache
        q_nope, q_rope, q_latent = self._project(x, cos, sin, latent_cache, plan)
        if self.indexer is not None:
            assert q_latent is not None
            plan.selections[self.source] = self.indexer(x, q_latent, cos, sin, kv_cache[1], plan)
        out = self.ops.sparse_mla_attention(
            q_nope, q_rope, latent_cache, plan, self.kv_b_matrix(), self.mla, self.scale, plan.selections[self.source]
        )
        return self._output(out)
