"""MixtralForCausalLM: softmax top-k routing renormalised over the chosen experts; no shared expert."""

from __future__ import annotations

from typing import Any

from moeserve.config import ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    num_layers = c.require("num_hidden_layers")
    head_dim = c.head_dim()
    return c.model_config(
        moe_intermediate_size=c.require("intermediate_size"),
        num_experts=c.require("num_local_experts"),
        router=RouterConfig(kind="softmax", top_k=c.require("num_experts_per_tok"), renormalize=True),
        rope=c.rope(head_dim),
        moe_layers=(True,) * num_layers,
        sliding_windows=c.sliding_windows(num_layers, enabled=True),
    )


ARCHITECTURE = Architecture(
    hf_names=("MixtralForCausalLM",),
    parse_config=parse_config,
    names=CheckpointNames(moe="block_sparse_moe", expert_gate="w1", expert_up="w3", expert_down="w2"),
)
