"""The decoder-only MoE transformer every supported architecture instantiates.

Architectures differ in configuration (router kind, shared expert, qk-norm, MLA, which layers
are dense) and in checkpoint names, not in structure; both differences live in
`architectures/`, so this file holds the one forward pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.cache_spec import CacheSpecs, LayerSpec
from moeserve.config import ModelConfig
from moeserve.dispatch import Dispatcher, ExpertMap, ReplicaTable
from moeserve.dispatch.base import Steps, finish
from moeserve.models.layers.attention import Attention
from moeserve.models.layers.dsa import SparseMLAttention
from moeserve.models.layers.gated_deltanet import GatedDeltaNet
from moeserve.models.layers.mla import MLAttention
from moeserve.models.layers.mlp import GatedMLP
from moeserve.models.layers.moe import MoEBlock
from moeserve.models.layers.norm import RMSNorm
from moeserve.models.layers.rotary import RotaryEmbedding
from moeserve.models.mtp import MTPLayer
from moeserve.models.tensor_parallel import SINGLE, TensorParallel
from moeserve.models.v4.cache import layer_specs as v4_layer_specs
from moeserve.ops import TORCH_OPS, LayerOps
from moeserve.ops.attention import AttentionPlan
from moeserve.ops.state_batch import StateStep

LayerCache = torch.Tensor | tuple[torch.Tensor, ...] | StateStep
"""What a layer's forward gets of the cache: an attention layer its paged tensor (a DSA layer
with an indexer: its latent and its indexer keys), a Gated DeltaNet its state bound to the step."""


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
    """Shape of one attention layer's KV cache on a rank of a `tp_size`-way group, known without a
    model, so a process that holds no weights can size the cache."""
    attention_cls = MLAttention if cfg.is_mla else Attention
    return attention_cls.cache_shape(cfg, num_blocks, block_size, tp_size)


def cache_specs(cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1, mtp_layers: int = 0) -> CacheSpecs:
    """What each layer keeps on a rank of a `tp_size`-way group: the decoder layers', then the
    `mtp_layers` MTP layers' (attention, as the last layer's kind), known without a model."""
    if cfg.compressed_attention is not None:  # DeepSeek-V4: several specs per layer
        return CacheSpecs(tuple(v4_layer_specs(cfg, i, dtype) for i in range(cfg.num_layers + mtp_layers)))
    attention_cls = MLAttention if cfg.is_mla else Attention

    def spec(layer: int) -> LayerSpec:
        if cfg.is_linear(layer):
            return GatedDeltaNet.cache_spec(cfg, dtype, tp_size)
        if cfg.dsa is not None:
            return SparseMLAttention.layer_cache_spec(cfg, layer, dtype, tp_size)
        return attention_cls.cache_spec(cfg, dtype, tp_size)

    return CacheSpecs(tuple(spec(i) for i in range(cfg.num_layers + mtp_layers)))


class DecoderLayer(nn.Module):
    """Attention then FFN, each with a residual. Under tensor parallelism (see
    `tensor_parallel`) the FFN, dense or MoE, runs on this rank's slice of the tokens.

    The residual stream travels between layers as two terms, as in vLLM: a sub-layer's output and
    the residual it is to be added to. Each add is done by the norm that follows it
    (`RMSNorm.add`), which a backend fuses into one pass over the activations.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dispatcher: Dispatcher,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
        mtp_index: int | None = None,
    ) -> None:
        """mtp_index: this is MTP layer `mtp_index`, built like decoder layer `layer`; its sparse
        attention (DSA) is then checkpoint layer `num_layers + mtp_index`'s, with an indexer and
        indexer keys of its own as the releases' MTP layers have, whatever `layer` has."""
        super().__init__()
        attention_cls = MLAttention if cfg.is_mla else Attention
        self.tp = tp
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        if cfg.is_linear(layer):
            self.linear_attn: GatedDeltaNet | None = GatedDeltaNet(cfg, dtype, device, tp, ops)
        else:
            self.linear_attn = None
            if cfg.dsa is not None:
                own = layer if mtp_index is None else cfg.num_layers + mtp_index
                self.attn = SparseMLAttention(cfg, own, dtype, device, tp, ops)
            else:
                self.attn = attention_cls(cfg, layer, dtype, device, tp, ops)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        if cfg.moe_layers[layer]:
            self.mlp: nn.Module = MoEBlock(cfg, dispatcher, dtype, device, ops)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerCache,
        plan: AttentionPlan,
        max_tokens_per_rank: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream `x + residual`, both on this rank's token slice -> (FFN output, residual) on it.

        For the first layer residual is None and x the embedded tokens, the same on every rank.
        Under tensor parallelism the input norm runs on the slice and its output is gathered for
        attention: the same rows, and the same bytes moved, as gathering the stream itself.
        max_tokens_per_rank: this step's bound on the tokens any rank's FFN dispatches (MoE only).
        """
        normed, residual = self._attention(x, residual, cos, sin, kv_cache, plan)
        if isinstance(self.mlp, MoEBlock):
            return self.mlp(normed, max_tokens_per_rank), residual
        return self.mlp(normed), residual

    def forward_steps(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerCache,
        plan: AttentionPlan,
        max_tokens_per_rank: int | None = None,
    ) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
        """forward() in steps: an MoE layer yields at its dispatch and combine (`MoEBlock.forward_steps`),
        a dense one runs in one step. The tensor-parallel collectives stay blocking calls inside a
        step, so every rank of a group makes them in the same order whatever the interleaving."""
        normed, residual = self._attention(x, residual, cos, sin, kv_cache, plan)
        if isinstance(self.mlp, MoEBlock):
            out = yield from self.mlp.forward_steps(normed, max_tokens_per_rank)
            return out, residual
        return self.mlp(normed), residual

    def _attention(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: LayerCache,
        plan: AttentionPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add, norm, attention, residual add, norm: (the FFN's input, the residual), on
        this rank's token slice."""
        num_tokens = plan.num_tokens
        if residual is None:
            normed, residual = self.input_norm(x), x[self.tp.token_slice(num_tokens)]
        else:
            normed_slice, residual = self.input_norm.add(x, residual)
            normed = self.tp.all_gather_tokens(normed_slice, num_tokens)
        if self.linear_attn is not None:
            mixed = self.linear_attn(normed, kv_cache)
        else:
            mixed = self.attn(normed, cos, sin, kv_cache, plan)
        return self.post_attn_norm.add(self.tp.reduce_scatter_tokens(mixed), residual)


class MoECausalLM(nn.Module):
    """Token ids of one step (all sequences packed, no padding) -> hidden states -> logits.

    Parameters are allocated uninitialised; the loader fills every one of them or fails.
    `with_mtp`: also hold the checkpoint's multi-token prediction layers (`mtp`), which draft
    tokens for speculative decoding; their KV caches follow the decoder layers' in `kv_caches`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dispatcher: Dispatcher,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        tp: TensorParallel = SINGLE,
        ops: LayerOps = TORCH_OPS,
        with_mtp: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.tp = tp
        self.ops = ops
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dispatcher, dtype, device, tp, ops) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = RotaryEmbedding(cfg.rope, device)
        # MTP layers have full attention: built like the last MoE layer that is no Gated DeltaNet.
        template = next((i for i in reversed(cfg.moe_layer_indices) if not cfg.is_linear(i)), 0)
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, DecoderLayer(cfg, template, dispatcher, dtype, device, tp, ops, i), dtype, device, tp, ops)
            for i in range(cfg.num_mtp_layers if with_mtp else 0)
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache on this rank (all layers are alike)."""
        return kv_cache_shape(self.cfg, num_blocks, block_size, self.tp.size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: list[LayerCache],
        max_tokens_per_rank: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions `[T]` -> final hidden states `[T, H]` (after the last norm).

        `plan`: this model's `ops.plan_attention` of the step, made once for every layer.
        max_tokens_per_rank: the most tokens any rank of the EP group dispatches in an MoE layer
        this step, the same on every rank (None: unknown); lets a dispatcher skip host syncs.
        """
        return self.forward_with_stream(input_ids, positions, plan, kv_caches, max_tokens_per_rank)[0]

    def forward_with_stream(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: list[LayerCache],
        max_tokens_per_rank: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(), and what the MTP layers read `[T, H]`: the final hidden states themselves
        (`models/mtp.py`: every release's MTP layer reads the target's output after its final norm)."""
        hidden = finish(self._layers(input_ids, positions, plan, kv_caches, max_tokens_per_rank, in_steps=False))
        return hidden, hidden

    def forward_steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: list[LayerCache],
        max_tokens_per_rank: int | None = None,
    ) -> Steps[torch.Tensor]:
        """forward() in steps, for one micro-batch of two-batch overlap: yields at every MoE
        layer's dispatch and combine (see `MoEBlock.forward_steps`) and returns what forward()
        returns. A micro-batch may be empty (T = 0): it still joins every collective.

        max_tokens_per_rank: a bound on the tokens any rank dispatches for this micro-batch."""
        return (yield from self._layers(input_ids, positions, plan, kv_caches, max_tokens_per_rank, in_steps=True))

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: list[LayerCache],
        max_tokens_per_rank: int | None,
        in_steps: bool,
    ) -> Steps[torch.Tensor]:
        """The one body of forward() and forward_steps(): the final hidden states `[T, H]`. Without
        `in_steps` each layer is called as a module (one step, forward hooks fire); with it,
        through its own steps."""
        x = F.embedding(input_ids, self.embed_tokens)  # [T, H]
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # [T, rotary_dim], once for all layers
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            args = (x, residual, cos, sin, kv_cache, plan, max_tokens_per_rank)
            if in_steps:
                x, residual = yield from layer.forward_steps(*args)
            else:
                x, residual = layer(*args)
        hidden, _ = self.norm.add(x, residual)
        return self.tp.all_gather_tokens(hidden, input_ids.shape[0])

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE layers' blocks in model order (the order `ExpertMap` layers are in)."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def rehome(
        self, dispatcher: Dispatcher, expert_params: list[dict[str, torch.Tensor]], expert_map: ExpertMap, rank: int
    ) -> None:
        """After lost ranks: every MoE layer serves `dispatcher`'s slots with `expert_params[i]`
        (`MoEBlock.rehome`) and routes through `expert_map` as group rank `rank`."""
        blocks = self.moe_blocks()
        if len(expert_params) != len(blocks):
            raise ValueError(f"expert weights for {len(expert_params)} MoE layers, the model has {len(blocks)}")
        for block, params in zip(blocks, expert_params):
            block.rehome(dispatcher, params)
        self.set_expert_map(expert_map, rank)

    def set_expert_map(self, expert_map: ExpertMap, rank: int) -> None:
        """Route through `expert_map`'s physical slots from the next step on (the expert weights
        must already be the ones it names for `rank`); an identity map routes by the ids as they are."""
        blocks = self.moe_blocks()
        if expert_map.num_layers != len(blocks):
            raise ValueError(f"the expert map has {expert_map.num_layers} MoE layers, the model {len(blocks)}")
        for i, block in enumerate(blocks):
            device = block.routed_tokens.device
            block.replicas = None if expert_map.is_identity else ReplicaTable(expert_map.replicas(i), rank, device)

    @contextmanager
    def counting_rows(self, rows: torch.Tensor) -> Iterator[None]:
        """Within: the MoE load counters count only the tokens where `rows` (bool `[T]`) is True.
        A captured decode step runs inside it, so its pad rows are no load (see
        `MoEBlock.counted_rows`); a CUDA graph keeps the masked counting it captured."""
        blocks = self.moe_blocks()
        for block in blocks:
            block.counted_rows = rows
        try:
            yield
        finally:
            for block in blocks:
                block.counted_rows = None

    def take_dispatch_rows(self) -> list[int]:
        """Rows this rank dispatched to each rank, all MoE layers, since the last call (then reset)."""
        blocks = self.moe_blocks()
        if not blocks:
            return []
        rows = torch.stack([block.dispatch_rows for block in blocks]).sum(0)
        for block in blocks:
            block.dispatch_rows.zero_()
        return rows.tolist()

    def take_routed_tokens(self) -> list[list[int]]:
        """Per MoE layer, rows each local expert received since the last call (then reset).

        One read of every layer's device counters together: the only sync the counters cost.
        """
        blocks = self.moe_blocks()
        if not blocks:
            return []
        counts = torch.stack([block.routed_tokens for block in blocks])
        for block in blocks:
            block.routed_tokens.zero_()
        return counts.tolist()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[S, H]` (only the rows that sample) -> logits `[S, V]` float32."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, head).float()
