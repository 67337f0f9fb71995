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
    num_heads = c.require("num_attention_heads")
    head_dim = c.head_dim()
    bias = bool(c.get("attention_bias", False))
    clip = c.get("clip_qkv", None)
    return ModelConfig(
        architecture=c.architecture,
        vocab_size=c.require("vocab_size"),
        hidden_size=c.require("hidden_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads", num_heads),
        head_dim=head_dim,
        intermediate_size=c.require("intermediate_size"),
        moe_intermediate_size=c.require("intermediate_size"),
        num_experts=c.require("num_experts", "num_local_experts"),
        router=RouterConfig(
            kind="softmax", top_k=c.require("num_experts_per_tok"), renormalize=bool(c.get("norm_topk_prob", False))
        ),
        rope=c.rope(c.rotary_dim(head_dim)),
        rms_norm_eps=c.require("rms_norm_eps", kind=float),
        max_position_embeddings=c.require("max_position_embeddings"),
        moe_layers=(True,) * num_layers,
        sliding_windows=(None,) * num_layers,  # transformers builds OLMoE's mask fully causal
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=None if clip is None else float(clip),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        eos_token_ids=c.eos_token_ids(),
        checkpoint_dtype=c.dtype(),
    )


ARCHITECTURE = Architecture(hf_names=("OlmoeForCausalLM",), parse_config=parse_config, names=CheckpointNames())
