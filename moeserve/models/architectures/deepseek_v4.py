"""DeepSeek-V4 (`DeepseekV4ForCausalLM`): compressed attention, hyper-connections, hash-routed experts.

Per layer (`layer_types`, or the released `compress_ratios` of 0 / 4 / 128): attention over a
sliding window alone, or also over entries compressed from every 4 tokens (CSA, with a lightning
indexer) or every 128 (HCA); compressed layers rotate by the `compress` rope (YaRN in the
releases), window-only ones by `main`. Every layer is MoE: the first ones (`mlp_layer_types`
`hash_moe`, or the released `num_hash_layers`, 3 by default) route by a token-id table, the rest
by sqrtsoftplus scores with a correction bias; experts and the shared expert clamp their SwiGLU
at `swiglu_limit`. Both config forms are read: transformers' (nested `rope_parameters`,
`compress_rates`) and the released one's legacy keys.
"""

from __future__ import annotations

from typing import Any

from moeserve.config import (
    CompressedAttentionConfig,
    GatedActivation,
    HyperConnectionConfig,
    ModelConfig,
    RopeConfig,
    RouterConfig,
)
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig
from moeserve.models.checkpoint import CheckpointError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
DEFAULT_RATES = {CSA: 4, HCA: 128}


def _compress_ratios(c: HFConfig, num_layers: int) -> tuple[tuple[int, ...], int]:
    """Per layer the tokens per compressed entry (0: window only), and CSA's ratio."""
    rates = {**DEFAULT_RATES, **(c.get("compress_rates", {}))}
    rates[CSA] = c.get("compress_rate_csa", rates[CSA])
    rates[HCA] = c.get("compress_rate_hca", rates[HCA])
    types = c.get("layer_types", None)
    if types is None:
        legacy = c.get("compress_ratios", None)
        if legacy is None:  # transformers' default: two HCA layers, then CSA and HCA in turn
            types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
        else:
            by_ratio = {0: SLIDING, 4: CSA, 128: HCA}
            unknown = sorted(set(legacy) - set(by_ratio))
            if unknown:
                raise CheckpointError(f"config.json compress_ratios holds {unknown}; DeepSeek-V4 has 0, 4 and 128")
            types = [by_ratio[r] for r in legacy]
    types = list(types)[:num_layers]
    unknown = sorted(set(types) - {SLIDING, CSA, HCA})
    if unknown or len(types) != num_layers:
        raise CheckpointError(f"config.json layer_types must be {num_layers} of {SLIDING}, {CSA}, {HCA}; got {types}")
    return tuple(0 if t == SLIDING else rates[t] for t in types), rates[CSA]


def _hash_layers(c: HFConfig, num_layers: int) -> tuple[bool, ...]:
    types = c.get("mlp_layer_types", None)
    if types is None:
        num_hash = c.get("num_hash_layers", 3)
        return tuple(i < num_hash for i in range(num_layers))
    types = list(types)[:num_layers]
    if sorted(set(types) - {"hash_moe", "moe"}) or len(types) != num_layers:
        raise CheckpointError(f"config.json mlp_layer_types must be {num_layers} of hash_moe / moe; got {types}")
    return tuple(t == "hash_moe" for t in types)


def _ropes(c: HFConfig, rotary_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """The main rope and the compressed branches', nested (`main`, `compress`) as transformers
    writes them or flat as released (`rope_theta`, `compress_rope_theta` with `rope_scaling`)."""
    params = c.raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:
        flat = {
            **(c.raw.get("rope_scaling") or {}),
            **{k: v for k, v in params.items() if k not in ("main", "compress")},
        }
        main = {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0)}
        kind = flat.get("rope_type", flat.get("type", "default"))  # older configs say `type`
        compress = {**flat, "rope_type": kind, "rope_theta": c.get("compress_rope_theta", 160000.0)}
        if kind == "yarn":
            compress.setdefault("attention_factor", 1.0)  # the reference leaves cos/sin unscaled
    return tuple(  # type: ignore[return-value]
        HFConfig({**c.raw, "rope_parameters": p, "rope_scaling": None}).rope(rotary_dim, interleaved=True)
        for p in (main, compress)
    )


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    num_layers = c.require("num_hidden_layers")
    head_dim = c.head_dim()
    factor = c.raw.get("partial_rotary_factor")
    rotary_dim = int(head_dim * factor) if factor else c.get("qk_rope_head_dim", head_dim // 8)
    main_rope, compress_rope = _ropes(c, rotary_dim)
    ratios, sparse_ratio = _compress_ratios(c, num_layers)
    moe_intermediate = c.require("moe_intermediate_size")
    num_heads = c.require("num_attention_heads")
    o_groups = c.require("o_groups")
    if num_heads % o_groups:
        raise CheckpointError(f"num_attention_heads {num_heads} is not a multiple of o_groups {o_groups}")
    limit = float(c.get("swiglu_limit", 10.0))
    return c.model_config(
        num_kv_heads=1,
        head_dim=head_dim,
        intermediate_size=moe_intermediate,
        moe_intermediate_size=moe_intermediate,
        num_experts=c.require("n_routed_experts", "num_local_experts"),
        router=RouterConfig(
            kind="sqrtsoftplus",
            top_k=c.require("num_experts_per_tok"),
            renormalize=True,
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            has_correction_bias=True,
        ),
        rope=main_rope,
        moe_layers=(True,) * num_layers,
        sliding_windows=(None,) * num_layers,
        shared_expert_intermediate_size=moe_intermediate * c.get("n_shared_experts", 1),
        shared_expert_activation=True,
        expert_activation=GatedActivation("clamped_silu", limit=limit),
        compressed_attention=CompressedAttentionConfig(
            q_lora_rank=c.require("q_lora_rank"),
            o_groups=o_groups,
            o_lora_rank=c.require("o_lora_rank"),
            window=c.require("sliding_window"),
            compress_ratios=ratios,
            sparse_ratio=sparse_ratio,
            index_n_heads=c.require("index_n_heads"),
            index_head_dim=c.require("index_head_dim"),
            index_topk=c.require("index_topk"),
            compress_rope=compress_rope,
        ),
        hyper_connections=HyperConnectionConfig(
            mult=c.get("hc_mult", 4),
            sinkhorn_iters=c.get("hc_sinkhorn_iters", 20),
            eps=float(c.get("hc_eps", 1e-6)),
        ),
        hash_moe_layers=_hash_layers(c, num_layers),
        num_mtp_layers=c.get("num_nextn_predict_layers", 0),
    )


ARCHITECTURE = Architecture(
    hf_names=("DeepseekV4ForCausalLM",),
    parse_config=parse_config,
    names=CheckpointNames(shared_expert="shared_experts", fused_experts=True, fused_layout="rows"),
)
