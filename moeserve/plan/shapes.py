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

from moeserve.cache_spec import ITEMSIZES
from moeserve.config import BlockFP8Config, ModelConfig, MXFP4Config, NVFP4Config, PackedInt4Config

CONFIGS = Path(__file__).parent / "configs"
MXFP4_BYTES = 4.25 / 8  # e2m1 code (4 bits) + one e8m0 scale per 32 values
NVFP4_BYTES = 4.5 / 8  # e2m1 code (4 bits) + one e4m3 scale per 16 values


def int4_bytes(group: int) -> float:
    """Bytes per value of compressed-tensors INT4: a 4-bit code + a bf16 scale per `group` values."""
    return (4 + 16 / group) / 8


def known_models() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


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
    attention: Literal["mla", "gqa"]
    heads: int
    kv_heads: int
    head_dim: int
    """GQA: the head size; MLA: qk_nope + qk_rope."""
    attn_params: int
    """One layer's attention projections."""
    attn_ctx_flops: int
    """Decode FLOPs per query token, per context token, per layer (MLA: absorbed)."""
    prefill_ctx_flops: int
    """Prefill FLOPs per query token, per context token, per layer (MLA: not absorbed)."""
    kv_bytes: int
    """KV cache bytes per token and layer (bf16 cache)."""
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
    aside per slot (`CacheSpecs.state_bytes_per_sequence`)."""

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
    if config.compressed_attention is not None:  # the cost model has none of these terms
        raise ValueError(
            f"{name}: the planner does not model DeepSeek-V4 yet ({config.architecture}): its step cost has no "
            "attention over a sliding window plus compressed entries (nor the CSA indexer), no hyper-connection "
            "streams or grouped output projection, and its memory no block-table groups; "
            "`moeserve plan --cache-per-sequence` gives its cache bytes per sequence"
        )
    h = config.hidden_size
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
        kind: Literal["mla", "gqa"] = "mla"
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
    quant = config.weight_quant
    dense_bytes = 1.0 if isinstance(quant, BlockFP8Config) else 2.0
    expert_bytes = dense_bytes
    if isinstance(quant, MXFP4Config):
        expert_bytes = MXFP4_BYTES
    elif isinstance(quant, NVFP4Config):
        expert_bytes = NVFP4_BYTES
    elif isinstance(quant, PackedInt4Config):
        expert_bytes = int4_bytes(quant.group_size)
    return ModelShape(
        name=name,
        hidden=h,
        layers=config.num_layers,
        moe_layers=sum(config.moe_layers),
        vocab=config.vocab_size,
        experts=config.num_experts,
        top_k=config.router.top_k,
        expert_inter=config.moe_intermediate_size,
        dense_inter=config.intermediate_size,
        shared_inter=config.shared_expert_intermediate_size,
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
        expert_weight_bytes=expert_bytes,
        dense_weight_bytes=dense_bytes,
        fp8_experts=isinstance(quant, BlockFP8Config),
        index_topk=dsa.index_topk if dsa else 0,
        indexer_share=sum(dsa.indexer_layers) / config.num_layers if dsa else 0.0,
        # per indexer head: a score over its keys, then the weighted sum (`plan.sparse_attention`)
        indexer_ctx_flops=dsa.index_n_heads * (2 * dsa.index_head_dim + 2) if dsa else 0,
        indexer_key_bytes=2 * dsa.index_head_dim if dsa else 0,
        **linear_fields(config),
    )


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
