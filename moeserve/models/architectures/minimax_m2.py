"""MiniMax-M2 (`MiniMaxM2ForCausalLM`), as transformers implements it.

Routing: sigmoid scores, a per-expert correction bias (`block_sparse_moe.e_score_correction_bias`,
on the MoE block rather than its gate) used only for choosing the top-k, weights the chosen
unbiased scores always renormalised, no groups and no scale: DeepSeek-V3's router with one
group. Attention: RMSNorm over the whole q and k projections (all heads together, as OLMoE),
rotary over the first `rotary_dim` (or `partial_rotary_factor`) dims of each head, no biases.
Every layer is MoE; experts are sized by `intermediate_size` and named as Mixtral's (w1/w2/w3).

The released config.json also carries fields of MiniMax's own remote code that transformers
does not read (`use_qk_norm`, `qk_norm_type`, `scoring_func`, `use_routing_bias`): values that
would make that code compute something else than transformers does are refused.
"""

from __future__ import annotations

from typing import Any

from moeserve.config import ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig
from moeserve.models.checkpoint import CheckpointError

DEFAULT_THETA = 5_000_000.0  # MiniMaxM2Config.default_theta

# Remote-code fields and the only values transformers' implementation agrees with.
_REMOTE_CODE_VALUES = {
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
}


def _check_remote_code_fields(c: HFConfig) -> None:
    for key, expected in _REMOTE_CODE_VALUES.items():
        value = c.raw.get(key)
        if value is not None and value != expected:
            raise CheckpointError(
                f"MiniMax-M2 config.json has {key}={value!r}; only {expected!r} is supported (what transformers does)"
            )


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    _check_remote_code_fields(c)
    num_layers = c.require("num_hidden_layers")
    head_dim = c.head_dim()
    return c.model_config(
        moe_intermediate_size=c.require("intermediate_size"),
        num_experts=c.require("num_local_experts", "num_experts"),
        router=RouterConfig(
            kind="grouped_sigmoid",
            top_k=c.require("num_experts_per_tok"),
            renormalize=True,
            has_correction_bias=True,
            logits_in_fp32=True,
        ),
        rope=c.rope(c.rotary_dim(head_dim), default_theta=DEFAULT_THETA),
        moe_layers=(True,) * num_layers,
        sliding_windows=(None,) * num_layers,
        qk_norm="full",
    )


ARCHITECTURE = Architecture(
    hf_names=("MiniMaxM2ForCausalLM",),
    parse_config=parse_config,
    names=CheckpointNames(
        moe="block_sparse_moe",
        expert_gate="w1",
        expert_up="w3",
        expert_down="w2",
        correction_bias="e_score_correction_bias",
    ),
)
