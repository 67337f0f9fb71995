"""DeepSeek-V4's attention layer: shared-KV multi-query attention over a sliding window plus the
layer's compressed entries, with per-head sinks and a grouped output projection.

One `head_dim` head per token (`kv_proj`, RMS-normalised, its last channels rotated) is read as
key and value by every query head. A query sees the last `window` tokens (itself included) and,
on a compressed layer, the entries of windows already closed at its position: all of them (HCA),
or those its lightning indexer picks (CSA). A learnt sink logit per head joins every softmax.
Since the value carries the key's rotation, the output's rotated channels are turned back at the
query's position; the heads are then projected per group (`o_a_proj`, block diagonal) and mixed
(`o_b_proj`).

`forward_sequence` is the reference over one whole sequence from position 0; the served path
feeds the same pieces from the cache, its attention and its indexer's choice through the ops
backend (`LayerOps.compressed_attention`, `compressed_select`: torch or the Triton kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.models.layers.linear import Linear
from moeserve.models.v4.cache import LayerCache, SequenceView, write_rows
from moeserve.models.v4.compressor import Compressor, Drafts, Indexer
from moeserve.models.v4.norm import Float32RMSNorm, unweighted_rms_norm
from moeserve.models.v4.rotary import TailRotary, rotate_tail
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.compressed_attention import (
    PagedRows,
    SequenceKeys,
    sink_attention,
    visible_entries,
    window_visible,
)


class GroupedLinear(nn.Module):
    """A block-diagonal projection: group g of `[S, G, in]` by rows `g * out : (g + 1) * out` of
    the `[G * out, in]` weight (the checkpoint's `o_a_proj.weight`) -> `[S, G, out]`."""

    fp8_dequantized_at_load = True
    """Its einsum reads `weight` (no ops-backend FP8 product): an FP8 release's is dequantized at
    load (`quantized_sources.FP8DequantizedSource`), not at every read of every step."""

    def __init__(self, in_dim: int, out_dim: int, groups: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(
            torch.empty(groups * out_dim, in_dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.einsum("sgi,goi->sgo", rows, self.weight.view(self.groups, -1, rows.shape[-1]))


class CompressedAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        ops: LayerOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        ca = cfg.compressed_attention
        assert ca is not None
        h, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads
        self.num_heads, self.head_dim, self.window, self.eps = heads, hd, ca.window, cfg.rms_norm_eps
        self.o_groups, self.ops = ca.o_groups, ops
        self.ratio = ca.ratio(layer)
        self.q_a_proj = Linear(h, ca.q_lora_rank, False, dtype, device, ops)
        self.q_a_norm = Float32RMSNorm(ca.q_lora_rank, cfg.rms_norm_eps, device)
        self.q_b_proj = Linear(ca.q_lora_rank, heads * hd, False, dtype, device, ops)
        self.kv_proj = Linear(h, hd, False, dtype, device, ops)
        self.kv_norm = Float32RMSNorm(hd, cfg.rms_norm_eps, device)
        self.o_a_proj = GroupedLinear(heads * hd // ca.o_groups, ca.o_lora_rank, ca.o_groups, dtype, device)
        self.o_b_proj = Linear(ca.o_groups * ca.o_lora_rank, h, False, dtype, device, ops)
        self.sinks = nn.Parameter(torch.empty(heads, device=device), requires_grad=False)
        self.rotary = TailRotary(ca.compress_rope if self.ratio else cfg.rope, device)
        self.compressor: Compressor | None = None
        if self.ratio:
            sparse = self.ratio == ca.sparse_ratio
            self.compressor = Compressor(h, hd, self.ratio, sparse, cfg.rms_norm_eps, self.rotary, dtype, device, ops)
            if sparse:
                self.compressor.indexer = Indexer(
                    h,
                    ca.q_lora_rank,
                    ca.index_n_heads,
                    ca.index_head_dim,
                    self.ratio,
                    ca.index_topk,
                    cfg.rms_norm_eps,
                    self.rotary,
                    dtype,
                    device,
                    ops,
                )

    @property
    def indexer(self) -> Indexer | None:
        """A CSA layer's lightning indexer (under the compressor, as the checkpoint names it)."""
        return getattr(self.compressor, "indexer", None)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[S, H]` -> (q_residual `[S, q_lora]`, the rotated queries `[S, Hq, D]`)."""
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(x.shape[0], self.num_heads, self.head_dim), self.eps)
        return q_residual, rotate_tail(q, cos, sin)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[S, H]` -> each token's rotated shared key and value `[S, D]`."""
        return rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin)

    def output(self, attended: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """attended `[S, Hq, D]` -> `[S, H]`: rotated back at the query, projected per group, mixed."""
        group_width = self.num_heads * self.head_dim // self.o_groups
        rows = rotate_tail(attended, cos, -sin).reshape(attended.shape[0], self.o_groups, group_width)
        return self.o_b_proj(self.o_a_proj(rows).flatten(1))

    def forward_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """One whole sequence `[S, H]` from position 0 -> `[S, H]`, its cache built on the way."""
        positions = torch.arange(x.shape[0], device=x.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q_residual, q = self.queries(x, cos, sin)
        keys = self.keys(x, cos, sin)
        visible = window_visible(positions, positions, self.window)
        if self.compressor is not None:
            entries = self.compressor.sequence_entries(x)
            if self.indexer is None:
                chosen = visible_entries(positions, entries.shape[0], self.ratio)
            else:
                chosen = self.indexer.select(x, q_residual, positions, self.indexer.sequence_entries(x))
            keys, visible = torch.cat([keys, entries]), torch.cat([visible, chosen], dim=1)
        attended = sink_attention(q, keys, visible, self.sinks, self.head_dim**-0.5)
        return self.output(attended, cos, sin)

    def write_keys(self, x: torch.Tensor, cache: LayerCache, seq: SequenceView) -> None:
        """Only the window keys of a sequence's rows x `[n, H]` from `seq.start`: rows whose
        outputs nobody reads (an MTP block's rows before the one it drafts from)."""
        positions = torch.arange(seq.start, seq.start + x.shape[0], device=x.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        write_rows(cache.window, seq.table((1, self.window)), seq.start, self.keys(x, cos, sin), seq.block_size)

    def forward_cached(self, x: torch.Tensor, cache: LayerCache, seq: SequenceView) -> torch.Tensor:
        """A sequence's next rows x `[n, H]` (a prompt chunk, a decode) -> `[n, H]`, reading and
        extending its cache: the window's keys, the entries, the open window's state."""
        start, bs = seq.start, seq.block_size
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        q_residual, q = self.queries(x, cos, sin)
        window = PagedRows(cache.window, seq.table((1, self.window)), bs)
        write_rows(window.cache, window.table, start, self.keys(x, cos, sin), bs)
        keys, selection = SequenceKeys(start, window, self.window), None
        if self.compressor is not None:
            table, state = seq.table((self.ratio, None)), cache.state
            assert cache.entries is not None
            keys = SequenceKeys(start, window, self.window, PagedRows(cache.entries, table, bs), self.ratio)
            verifies, kept = seq.drafts > 0, cache.kept
            self.compressor.extend(x, start, keys.entries, state[:4], seq.slot, Drafts(kept[:4], verifies, seq.restore))
            indexer = self.indexer
            if indexer is not None:
                assert cache.index_keys is not None
                index_keys = PagedRows(cache.index_keys, table, bs)
                indexer.extend(x, start, index_keys, state[4:], seq.slot, Drafts(kept[4:], verifies, seq.restore))
                selection = indexer.select_cached(x, q_residual, start, index_keys)
        attended = self.ops.compressed_attention(q, self.sinks, self.head_dim**-0.5, keys, selection)
        return self.output(attended, cos, sin)
