"""What the cost model needs of a model: its shapes, counted once from moeserve's own config.

A model is a checkpoint folder (its config.json, read by the same architecture code the server
loads with, so the planner and the server agree on every dimension) or a known name whose
config.json is stored beside this module (`configs/`, shapes only: no weights).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moeserve.cache_spec import ITEMSIZES, CacheSpecs
from moeserve.config import BlockFP8Config, ModelConfig, MXFP4Config, NVFP4Config, PackedInt4Config

CONFIGS = Path(__file__).parent / "configs"
BLOCK_SIZE = 16
"""Positions per block, the engine's default (`SchedulerConfig.block_size`): V4's windows are
held in whole blocks."""
MXFP4_BYTES = 4.25 / 8  # e2m1 code (4 bits) + one e8m0 scale per 32 values
NVFP4_BYTES = 4.5 / 8  # e2m1 code (4 bits) + one e4m3 scale per 16 values


def int4_bytes(group: int) -> float:
    """Bytes per value of compressed-tensors INT4: a 4-bit code + a bf16 scale per `group` values."""
    return (4 + 16 / group) / 8


def known_models() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


@dataclass(frozen=True)
class CompressedKind:
    """DeepSeek-V4's layers of one compression ratio: what their attention reads and computes
    beyond the window every layer has."""

    ratio: int
    """Context positions per compressed entry; 0: the window only."""
    layers: int
    topk: int = 0
    """CSA: the entries a query attends, as its indexer picks them; 0: all (HCA)."""
    entry_bytes: int = 0
    """One compressed entry's cache bytes (its `PagedSpec`)."""
    index_key_bytes: int = 0
    """CSA: one indexer key's cache bytes."""
    index_ctx_flops: int = 0
    """CSA: indexer FLOPs per query and entry: per indexer head a dot over its keys, the ReLU'd
    score weighted and summed."""
    compressor_params: int = 0
    """One layer's per-token projections beyond attention's: the compressor's values and gates
    (two series each with CSA's overlap), and the indexer's (its compressor's, its query
    projection from the q lora, its head weights)."""

    def entries(self, ctx: float) -> float:
        """Compressed entries a query at context `ctx` attends: ctx / ratio, at most top-k."""
        if not self.ratio:
            return 0.0
        closed = ctx / self.ratio
        return min(closed, self.topk) if self.topk else closed

    @property
    def bytes_per_context_token(self) -> float:
        """Cache bytes one more position of context adds to the layer: an entry per `ratio`."""
        return (self.entry_bytes + self.index_key_bytes) / self.ratio if self.ratio else 0.0


@dataclass(frozen=True)
class ModelShape:
    """Per-layer dimensions and bytes; counts are parameters, sizes bytes per parameter."""

    name: str
    hidden: int
    layers: int
    moe_layers: int
    vocab: int
    experts: int
    top_k: int
    expert_inter: int
    dense_inter: int
    shared_inter: int
    attention: Literal["mla", "gqa", "compressed"]
    """`compressed`: DeepSeek-V4's shared-KV MQA over a window plus compressed entries."""
    heads: int
    kv_heads: int
    head_dim: int
    """GQA: the head size; MLA: qk_nope + qk_rope; V4: its one shared key-and-value head's."""
    attn_params: int
    """One layer's attention projections."""
    attn_ctx_flops: int
    """Decode FLOPs per query token, per context token, per layer (MLA: absorbed)."""
    prefill_ctx_flops: int
    """Prefill FLOPs per query token, per context token, per layer (MLA: not absorbed)."""
    kv_bytes: int
    """KV cache bytes per token and layer (bf16 cache); V4: a window entry's."""
    window_share: float
    """Share of layers with a sliding window, and the window; their KV read is capped at it."""
    window: int
    expert_weight_bytes: float
    dense_weight_bytes: float
    fp8_experts: bool
    """Expert GEMMs run w8a8 FP8 (block-FP8 checkpoints); otherwise in bf16."""
    index_topk: int = 0
    """DeepSeek Sparse Attention: the context tokens MLA attends per query; 0: all (dense)."""
    indexer_share: float = 0.0
    """DSA: share of layers running an indexer (GLM-5's others reuse a layer's top-k)."""
    indexer_ctx_flops: int = 0
    """DSA: indexer FLOPs per query token, per context token, per indexer layer."""
    indexer_key_bytes: int = 0
    """DSA: indexer key cache bytes per token and indexer layer (bf16 cache)."""
    linear_layers: int = 0
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5: three of every four); the others attend."""
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_in_params: int = 0
    """One DeltaNet's in-projections as the checkpoint stores them: q, k, v, z (`in_proj_qkv` and
    `in_proj_z`, or `in_proj_qkvz`) and b, a (a row per value head each)."""
    linear_out_params: int = 0
    """One DeltaNet's `out_proj`."""
    linear_conv_params: int = 0
    """One DeltaNet's depthwise conv over the q, k and v channels: weights, not a GEMM."""
    linear_state_bytes: int = 0
    """One DeltaNet's recurrent state per sequence at TP 1: value heads x Dk x Dv in float32, as
    the engine keeps it (the layer's cache spec)."""
    state_bytes: int = 0
    """A sequence's states over every layer at TP 1, conv states included: what the engine sets
    aside per slot (`CacheSpecs.state_bytes_per_sequence`); V4: its open compression windows."""
    compressed_kinds: tuple[CompressedKind, ...] = ()
    """DeepSeek-V4: its layers by kind (window only, CSA, HCA)."""
    grouped_out_params: int = 0
    """V4: one layer's grouped output projection `wo_a` (G blocks of Hq D / G x o_lora), held in
    bf16 whatever the checkpoint (an FP8 release's is dequantized at load: `GroupedLinear`)."""
    hyper_streams: int = 0
    """V4: the residual's hyper-connection streams (`hc_mult`)."""
    hyper_params: int = 0
    """V4: one layer's two hyper-connection mixers' float32 projections ((2 + n) n rows over the
    n H flattened streams each)."""
    sequence_block_bytes: int = 0
    """V4: block bytes a running sequence holds whatever its context, as the engine sets them
    aside (`worker.kv_cache.context_blocks`): its window groups' window and a block either side,
    and a partly filled block of each compressed group."""
    kept_bytes_per_draft: int = 0
    """V4: what each verified token adds to the inputs a sequence keeps to step back past
    rejected drafts (`models.v4.cache.kept_bytes_per_sequence` grows by this per draft state)."""

    @property
    def compressor_params(self) -> int:
        """V4: the compressors' and indexers' per-token projections over all layers."""
        return sum(kind.layers * kind.compressor_params for kind in self.compressed_kinds)

    @property
    def attention_replicated(self) -> bool:
        """Whether every rank of a TP group runs the whole attention (DeepSeek-V4: the server
        does not shard it; the MoE takes each rank's slice of the tokens and all-gathers)."""
        return bool(self.compressed_kinds)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def attention_layers(self) -> int:
        """Layers that attend over a KV cache: all but the DeltaNets."""
        return self.layers - self.linear_layers

    def splits_over(self, tp: int) -> bool:
        """Whether TP `tp` divides the heads the model splits: attention's query heads and the
        DeltaNet's key and value heads (KV heads are replicated past their count)."""
        return not (self.heads % tp or self.linear_key_heads % tp or self.linear_value_heads % tp)

    @property
    def expert_params(self) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * self.hidden * self.expert_inter

    def kv_ctx(self, ctx: float) -> float:
        """Mean context a layer attends over at context `ctx` (windowed layers capped)."""
        return (1 - self.window_share) * ctx + self.window_share * min(ctx, self.window)

    def attended_ctx(self, ctx: float) -> float:
        """Context tokens attention reads per query at context `ctx`: DSA's top-k at most."""
        return min(self.kv_ctx(ctx), self.index_topk) if self.index_topk else self.kv_ctx(ctx)


def indexer_flops_per_key(heads: int, head_dim: int) -> int:
    """A lightning indexer's FLOPs per query and key (DSA, V4's CSA): per indexer head a dot
    over its key, then the ReLU'd score weighted into the sum."""
    return heads * (2 * head_dim + 2)


def linear_fields(config: ModelConfig) -> dict[str, int]:
    """A hybrid's `ModelShape` fields for its Gated DeltaNet layers, none for another model: the
    projections as `GatedDeltaNet` builds them, the states from the cache specs the engine
    budgets with, so the planner's state bytes are the engine's."""
    lin = config.linear_attention
    if lin is None or not any(config.linear_layers):
        return {}
    import torch

    from moeserve.models.decoder import cache_specs
    from moeserve.models.layers.gated_deltanet import GatedDeltaNet

    spec = GatedDeltaNet.cache_spec(config, torch.bfloat16)
    (_, recurrent), (_, recurrent_dtype) = spec.shapes, spec.dtypes  # (conv, recurrent)
    value_dim = lin.num_value_heads * lin.value_head_dim
    return {
        "linear_layers": sum(config.linear_layers),
        "linear_key_heads": lin.num_key_heads,
        "linear_value_heads": lin.num_value_heads,
        "linear_key_dim": lin.key_head_dim,
        "linear_value_dim": lin.value_head_dim,
        "linear_in_params": config.hidden_size * (lin.conv_channels + value_dim + 2 * lin.num_value_heads),
        "linear_out_params": value_dim * config.hidden_size,
        "linear_conv_params": lin.conv_channels * lin.conv_kernel,
        "linear_state_bytes": math.prod(recurrent) * ITEMSIZES[recurrent_dtype],
        "state_bytes": cache_specs(config, torch.bfloat16).state_bytes_per_sequence,
    }


def shape_of(config: ModelConfig, name: str) -> ModelShape:
    h = config.hidden_size
    if config.compressed_attention is not None:
        return compressed_shape(config, name)
    if config.mla is not None:
        m = config.mla
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank * config.num_heads * m.qk_head_dim
        else:
            q = h * config.num_heads * m.qk_head_dim
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * config.num_heads * (
            m.qk_nope_head_dim + m.v_head_dim
        )
        attn_params = q + kv + config.num_heads * m.v_head_dim * h
        # absorbed decode: scores over the latent + rope part, values over the latent
        ctx_flops = 2 * config.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
        prefill_flops = 2 * config.num_heads * (m.qk_head_dim + m.v_head_dim)
        kv_bytes = 2 * (m.kv_lora_rank + m.qk_rope_head_dim)
        kind: Literal["mla", "gqa", "compressed"] = "mla"
        head_dim = m.qk_head_dim
    else:
        d = config.head_dim
        q_rows = config.num_heads * d * (2 if config.attention_output_gate else 1)  # a gate beside each query
        attn_params = h * (q_rows + 2 * config.num_kv_heads * d) + config.num_heads * d * h
        ctx_flops = prefill_flops = 4 * config.num_heads * d
        kv_bytes = 2 * 2 * config.num_kv_heads * d
        kind = "gqa"
        head_dim = d
    windows = [w for w in config.sliding_windows if w is not None]
    dsa = config.dsa
    return ModelShape(
        **common_fields(config, name),
        attention=kind,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=head_dim,
        attn_params=attn_params,
        attn_ctx_flops=ctx_flops,
        prefill_ctx_flops=prefill_flops,
        kv_bytes=kv_bytes,
        window_share=len(windows) / config.num_layers,
        window=min(windows) if windows else 0,
        index_topk=dsa.index_topk if dsa else 0,
        indexer_share=sum(dsa.indexer_layers) / config.num_layers if dsa else 0.0,
        indexer_ctx_flops=indexer_flops_per_key(dsa.index_n_heads, dsa.index_head_dim) if dsa else 0,
        indexer_key_bytes=2 * dsa.index_head_dim if dsa else 0,
        **linear_fields(config),
    )


def common_fields(config: ModelConfig, name: str) -> dict:
    """The fields every architecture fills alike: sizes, the feed-forward half, weight bytes."""
    quant = config.weight_quant
    dense_bytes = 1.0 if isinstance(quant, BlockFP8Config) else 2.0
    expert_bytes = dense_bytes
    fp4_experts = isinstance(quant, BlockFP8Config) and quant.fp4_experts  # DeepSeek-V4: MXFP4's layout
    if isinstance(quant, MXFP4Config) or fp4_experts:
        expert_bytes = MXFP4_BYTES
    elif isinstance(quant, NVFP4Config):
        expert_bytes = NVFP4_BYTES
    elif isinstance(quant, PackedInt4Config):
        expert_bytes = int4_bytes(quant.group_size)
    return dict(
        name=name,
        hidden=config.hidden_size,
        layers=config.num_layers,
        moe_layers=sum(config.moe_layers),
        vocab=config.vocab_size,
        experts=config.num_experts,
        top_k=config.router.top_k,
        expert_inter=config.moe_intermediate_size,
        dense_inter=config.intermediate_size,
        shared_inter=config.shared_expert_intermediate_size,
        expert_weight_bytes=expert_bytes,
        dense_weight_bytes=dense_bytes,
        fp8_experts=isinstance(quant, BlockFP8Config) and not fp4_experts,
    )


def compressed_shape(config: ModelConfig, name: str) -> ModelShape:
    """DeepSeek-V4's shape: its projections as `CompressedAttention` builds them, its cache and
    states from the specs the engine budgets with (`models.v4.cache.layer_specs`), so the
    planner's bytes are the engine's. The MTP block is left out, as for every model."""
    import torch

    from moeserve.models.decoder import cache_specs
    from moeserve.models.v4.cache import kept_bytes_per_sequence

    ca, hc = config.compressed_attention, config.hyper_connections
    assert ca is not None and hc is not None
    h, heads, hd = config.hidden_size, config.num_heads, config.head_dim
    specs = cache_specs(config, torch.bfloat16)
    window_spec = specs.paged[0]
    attn_params = h * ca.q_lora_rank + ca.q_lora_rank * heads * hd + h * hd + ca.o_groups * ca.o_lora_rank * h
    return ModelShape(
        **common_fields(config, name),
        attention="compressed",
        heads=heads,
        kv_heads=1,
        head_dim=hd,
        attn_params=attn_params,  # q_a, q_b, the shared key-and-value, o_b
        # one key read as key and value: a score and a value of D each, per head and entry
        attn_ctx_flops=4 * heads * hd,
        prefill_ctx_flops=4 * heads * hd,
        kv_bytes=window_spec.bytes_per_token,
        window_share=1.0,
        window=ca.window,
        state_bytes=specs.state_bytes_per_sequence,
        compressed_kinds=compressed_kinds(config),
        grouped_out_params=heads * hd * ca.o_lora_rank,
        hyper_streams=hc.mult,
        hyper_params=2 * (2 + hc.mult) * hc.mult * hc.mult * h,
        sequence_block_bytes=sequence_block_bytes(specs),
        kept_bytes_per_draft=kept_bytes_per_sequence(specs, 1) - specs.state_bytes_per_sequence,
    )


def compressed_kinds(config: ModelConfig) -> tuple[CompressedKind, ...]:
    """V4's decoder layers grouped by ratio, each kind's cache bytes read off one of its layers'
    specs (window, entries, indexer keys, state: `models.v4.cache.layer_specs`)."""
    import torch

    from moeserve.models.v4.cache import layer_specs

    ca = config.compressed_attention
    assert ca is not None
    h = config.hidden_size
    ratios = [ca.ratio(i) for i in range(config.num_layers)]
    kinds = []
    for ratio in sorted(set(ratios)):
        specs = layer_specs(config, ratios.index(ratio), torch.bfloat16)
        if not ratio:
            kinds.append(CompressedKind(0, ratios.count(0)))
            continue
        sparse = ratio == ca.sparse_ratio
        width = (2 if sparse else 1) * config.head_dim  # CSA's overlap projects two series
        params = 2 * h * width  # values and gates
        if sparse:  # the indexer's overlapping compressor, its queries and its head weights
            di, hi = ca.index_head_dim, ca.index_n_heads
            params += 2 * h * 2 * di + ca.q_lora_rank * hi * di + h * hi
        kinds.append(
            CompressedKind(
                ratio,
                ratios.count(ratio),
                topk=ca.index_topk if sparse else 0,
                entry_bytes=specs[1].bytes_per_token,
                index_key_bytes=specs[2].bytes_per_token if sparse else 0,
                index_ctx_flops=indexer_flops_per_key(ca.index_n_heads, ca.index_head_dim) if sparse else 0,
                compressor_params=params,
            )
        )
    return tuple(kinds)


def sequence_block_bytes(specs: CacheSpecs) -> int:
    """What the engine sets aside per running sequence before it buys context: each group's
    pool for one more sequence (`scheduler.block_groups.group_block_counts`, which
    `worker.kv_cache.context_blocks` takes first), at a context too long to bound a window's
    pool: a window group's window and a block either side, a compressed group's partly filled
    block."""
    from moeserve.scheduler.block_groups import group_block_counts

    context = 1 << 40
    one, none = (group_block_counts(specs.groups, context, BLOCK_SIZE, n, 0) for n in (1, 0))
    sizes = specs.group_bytes_per_block(BLOCK_SIZE)
    return sum((a - b) * size for a, b, size in zip(one, none, sizes, strict=True))


def load_shape(model: str) -> ModelShape:
    """A known model by name, or a checkpoint folder (only its config.json is read)."""
    return shape_of(*load_config(model))


def load_config(model: str) -> tuple[ModelConfig, str]:
    """(its config, its name) of a known model by name or of a checkpoint folder."""
    from moeserve.models.architectures import resolve_architecture
    from moeserve.models.checkpoint import read_config

    path = Path(model)
    if (path / "config.json").is_file():
        raw, name = read_config(path), path.name
    elif (CONFIGS / f"{model}.json").is_file():
        raw, name = json.loads((CONFIGS / f"{model}.json").read_text()), model
    else:
        known = ", ".join(known_models())
        raise ValueError(f"--model {model!r} is neither a checkpoint folder nor a known model ({known})")
    return resolve_architecture(raw)[1], name
