"""DeepSeek-V3 and V2: MLA attention, dense first layers, shared experts.

V3 routes by sigmoid scores with a correction bias and group-limited top-k; V2 by softmax,
greedy or group-limited (`topk_method`), never renormalised. V2's complex-number rotary and
V3's interleaved rotary rotate the same pairs; they differ only in where the rotated values
are stored, which q and k share, so attention scores are identical and one path serves both.
"""

from __future__ import annotations

import math
from typing import Any

from moeserve.config import MLAConfig, ModelConfig, RopeConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig
from moeserve.models.checkpoint import CheckpointError


def _attention_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """YaRN checkpoints scale the softmax by mscale(factor, mscale_all_dim)^2 as well."""
    scale = qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def _router(c: HFConfig) -> RouterConfig:
    scale = float(c.get("routed_scaling_factor", 1.0))
    top_k = c.require("num_experts_per_tok")
    if c.architecture == "DeepseekV2ForCausalLM":
        method = c.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        grouped = method == "group_limited_greedy"
        return RouterConfig(
            kind="softmax",
            top_k=top_k,
            renormalize=False,
            routed_scaling_factor=scale,
            logits_in_fp32=True,
            num_groups=c.require("n_group") if grouped else 1,
            topk_groups=c.require("topk_group") if grouped else 1,
        )
    return RouterConfig(
        kind="grouped_sigmoid",
        top_k=top_k,
        renormalize=bool(c.get("norm_topk_prob", True)),
        num_groups=c.get("n_group", 1),
        topk_groups=c.get("topk_group", 1),
        routed_scaling_factor=scale,
        has_correction_bias=True,
        logits_in_fp32=True,
    )


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    num_layers = c.require("num_hidden_layers")
    num_experts = c.require("n_routed_experts", "num_local_experts")
    mla = MLAConfig(
        q_lora_rank=c.get("q_lora_rank", None),
        kv_lora_rank=c.require("kv_lora_rank"),
        qk_nope_head_dim=c.require("qk_nope_head_dim"),
        qk_rope_head_dim=c.require("qk_rope_head_dim"),
        v_head_dim=c.require("v_head_dim"),
    )
    rope = c.rope(mla.qk_rope_head_dim, interleaved=bool(c.get("rope_interleave", True)))
    first_dense = c.get("first_k_dense_replace", 0)
    num_heads = c.require("num_attention_heads")
    moe_intermediate = c.require("moe_intermediate_size")
    return c.model_config(
        num_kv_heads=num_heads,
        head_dim=mla.qk_head_dim,
        moe_intermediate_size=moe_intermediate,
        num_experts=num_experts,
        router=_router(c),
        rope=rope,
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
        num_mtp_layers=c.get("num_nextn_predict_layers", 0),
        sliding_windows=(None,) * num_layers,
        shared_expert_intermediate_size=moe_intermediate * c.get("n_shared_experts", 0),
        qkv_bias=bool(c.get("attention_bias", False)),
        o_bias=bool(c.get("attention_bias", False)),
        mla=mla,
        attention_scale=_attention_scale(mla.qk_head_dim, rope),
    )


ARCHITECTURE = Architecture(
    hf_names=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    parse_config=parse_config,
    names=CheckpointNames(shared_expert="shared_experts"),
)
