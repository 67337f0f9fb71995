"""OLMoE (`OlmoeForCausalLM`): every layer MoE, softmax top-k routing renormalised only with
`norm_topk_prob` (off in the released models), no shared expert, and an RMSNorm over the
whole q and k projections (all heads together, before the head split), with an optional
clamp of q, k and v (`clip_qkv`)."""

from __future__ import annotations

from typing import Any

from moeserve.config import ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    num_layers = c.require("num_hidden_layers")
    head_dim = c.head_dim()
    bias = bool(c.get("attention_bias", False))
    clip = c.get("clip_qkv", None)
    return c.model_config(
        moe_intermediate_size=c.require("intermediate_size"),
        num_experts=c.require("num_experts", "num_local_experts"),
        router=RouterConfig(
            kind="softmax", top_k=c.require("num_experts_per_tok"), renormalize=bool(c.get("norm_topk_prob", False))
        ),
        rope=c.rope(c.rotary_dim(head_dim)),
        moe_layers=(True,) * num_layers,
        sliding_windows=(None,) * num_layers,  # transformers builds OLMoE's mask fully causal
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
    )


ARCHITECTURE = Architecture(hf_names=("OlmoeForCausalLM",), parse_config=parse_config, names=CheckpointNames())
