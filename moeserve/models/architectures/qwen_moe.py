"""Qwen2-MoE and Qwen3-MoE.

Qwen2-MoE: q/k/v biases, a shared expert scaled by sigmoid(shared_expert_gate(x)).
Qwen3-MoE: no biases, RMSNorm over each head's q and k, no shared expert.
Both: softmax top-k, renormalised only with norm_topk_prob; dense MLP on `mlp_only_layers`
and on layers off the `decoder_sparse_step` grid.
"""

from __future__ import annotations

from typing import Any

from moeserve.config import ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig


def moe_layers(c: HFConfig, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    dense = set(c.get("mlp_only_layers", []))
    step = c.get("decoder_sparse_step", 1)
    return tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    qwen3 = c.architecture == "Qwen3MoeForCausalLM"
    num_layers = c.require("num_hidden_layers")
    num_experts = c.require("num_experts", "num_local_experts")
    head_dim = c.head_dim()
    return c.model_config(
        moe_intermediate_size=c.require("moe_intermediate_size"),
        num_experts=num_experts,
        router=RouterConfig(
            kind="softmax", top_k=c.require("num_experts_per_tok"), renormalize=bool(c.get("norm_topk_prob", False))
        ),
        rope=c.rope(head_dim),
        moe_layers=moe_layers(c, num_layers, num_experts),
        sliding_windows=c.sliding_windows(num_layers, enabled=bool(c.get("use_sliding_window", False))),
        shared_expert_intermediate_size=0 if qwen3 else c.get("shared_expert_intermediate_size", 0),
        shared_expert_gated=not qwen3,
        qkv_bias=bool(c.get("attention_bias", False)) if qwen3 else bool(c.get("qkv_bias", True)),
        o_bias=bool(c.get("attention_bias", False)) if qwen3 else False,
        qk_norm="head" if qwen3 else "none",
    )


ARCHITECTURE = Architecture(
    hf_names=("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    parse_config=parse_config,
    names=CheckpointNames(),
)
