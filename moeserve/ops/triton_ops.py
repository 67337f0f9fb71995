"""`TritonOps`: the `LayerOps` backend that runs the layers on moeserve's Triton kernels.

The GPU path. On CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`), which the
tests use to check that a whole model gives the torch path's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
from dataclasses import replace

import torch

from moeserve.config import RouterConfig
from moeserve.kernels.fused_moe import block_m_for, fused_moe
from moeserve.kernels.mla_attention import mla_decode
from moeserve.kernels.moe_align import moe_align_block_size
from moeserve.kernels.norm import rms_norm
from moeserve.kernels.paged_attention import paged_attention, paged_inputs
from moeserve.kernels.rotary import apply_rotary
from moeserve.kernels.routing import route
from moeserve.ops.attention import AttentionMetadata
from moeserve.ops.base import LayerOps


class TritonOps(LayerOps):
    name = "triton"

    @classmethod
    def supports(cls, device: torch.device) -> str | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return f"the Triton kernels run on CUDA devices (or, for tests, on CPU with TRITON_INTERPRET=1); device is {device}"
        return None

    def prepare_attention(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Block tables and lengths as device tensors, once per step for every layer."""
        inputs = paged_inputs(meta.block_tables, meta.start_positions, meta.query_lens, meta.block_size, meta.slot_mapping.device)
        return replace(meta, kernel=inputs)

    # The kernels take strided views and empty steps as they are: no copies on the way in.
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        return apply_rotary(x, cos, sin, interleaved)

    def paged_attention(self, q, k_cache, v_cache, meta, scale, sliding_window):
        return paged_attention(q, k_cache, v_cache, meta.kernel, scale, sliding_window)

    def mla_attention(self, q_nope, q_rope, kv_cache, meta, kv_b_weight, mla, scale):
        if q_nope.shape[0] == 0:
            return q_nope.new_empty(0, q_nope.shape[1], mla.v_head_dim)
        return mla_decode(q_nope, q_rope, kv_cache, kv_b_weight, meta.kernel, scale, mla)

    def route(self, cfg: RouterConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route(cfg, logits, correction_bias)

    def experts(self, x: torch.Tensor, num_tokens_per_expert: Sequence[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """Rows arrive grouped by expert (the dispatcher sorted them), so each row is one pair
        with top_k = 1 and the weights stay with combine()."""
        num_rows, num_experts = x.shape[0], w13.shape[0]
        if num_rows == 0:
            return torch.empty_like(x)
        counts = torch.tensor(list(num_tokens_per_expert), dtype=torch.int64, device=x.device)
        row_expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts, output_size=num_rows)
        aligned = moe_align_block_size(row_expert[:, None], num_experts, block_m_for(num_rows, 1, num_experts))
        return fused_moe(x.contiguous(), w13, w2, aligned, top_k=1)
