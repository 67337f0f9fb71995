"""GLM-4.5 / 4.6 MoE (`Glm4MoeForCausalLM`).

DeepSeek-V3's router (sigmoid scores, a correction bias used only for choosing, group-limited
top-k, renormalised with `norm_topk_prob`, then `routed_scaling_factor`), its dense first
layers (`first_k_dense_replace`) and shared experts, on grouped-query attention with q/k/v
biases (`attention_bias`; o_proj never has one), an optional RMSNorm over each head's q and k
(`use_qk_norm`) and rotary over the first `partial_rotary_factor` of each head (transformers'
default 0.5 when config.json omits it), in the rotate-half layout.
"""

from __future__ import annotations

from typing import Any

from moeserve.config import ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # Glm4MoeConfig's own default


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    num_layers = c.require("num_hidden_layers")
    head_dim = c.head_dim()
    moe_intermediate = c.require("moe_intermediate_size")
    first_dense = c.get("first_k_dense_replace", 1)
    return c.model_config(
        moe_intermediate_size=moe_intermediate,
        num_experts=c.require("n_routed_experts", "num_local_experts"),
        router=RouterConfig(
            kind="grouped_sigmoid",
            top_k=c.require("num_experts_per_tok"),
            renormalize=bool(c.get("norm_topk_prob", True)),
            num_groups=c.get("n_group", 1),
            topk_groups=c.get("topk_group", 1),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            has_correction_bias=True,
            logits_in_fp32=True,
        ),
        rope=c.rope(c.rotary_dim(head_dim, DEFAULT_PARTIAL_ROTARY_FACTOR)),
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
        num_mtp_layers=c.get("num_nextn_predict_layers", 0),
        sliding_windows=(None,) * num_layers,
        shared_expert_intermediate_size=moe_intermediate * c.get("n_shared_experts", 1),
        qkv_bias=bool(c.get("attention_bias", False)),
        qk_norm="head" if c.get("use_qk_norm", False) else "none",
    )


ARCHITECTURE = Architecture(
    hf_names=("Glm4MoeForCausalLM",),
    parse_config=parse_config,
    names=CheckpointNames(shared_expert="shared_experts"),
)
