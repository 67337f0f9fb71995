"""gpt-oss (`GptOssForCausalLM`), bf16/fp32 or as published, with MXFP4 routed experts (which
the loader keeps packed, `models/mxfp4.py`: nothing here depends on how the experts are stored).

Attention: q/k/v/o biases, a learnt per-head sink logit that joins every softmax (and takes
its share of the probability mass, then is dropped), sliding-window and full layers as
`layer_types` says (transformers' default: alternating, sliding first), YaRN rotary.
Router: a linear with bias, top-k of the logits, softmax over the k picked logits. Experts:
biased projections and the clamped SwiGLU `(clamp(up) + 1) * g * sigmoid(alpha * g)` with
`g = min(gate, limit)`, stored as four stacked tensors per layer (`CheckpointNames.fused_experts`).
"""

from __future__ import annotations

from typing import Any

from moeserve.config import GatedActivation, ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig

DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
# GptOssConfig's rope when config.json gives none.
DEFAULT_ROPE_SCALING = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _sliding_windows(c: HFConfig, num_layers: int) -> tuple[int | None, ...]:
    window = c.get("sliding_window", 128)
    layer_types = c.get("layer_types", None) or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
    ]
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    num_layers = c.require("num_hidden_layers")
    head_dim = c.head_dim()
    bias = bool(c.get("attention_bias", True))
    return c.model_config(
        moe_intermediate_size=c.require("intermediate_size"),
        num_experts=c.require("num_local_experts", "num_experts"),
        router=RouterConfig(
            kind="topk_softmax", top_k=c.require("num_experts_per_tok"), renormalize=False, has_bias=True
        ),
        rope=c.rope(head_dim, default_theta=DEFAULT_THETA, default_scaling=DEFAULT_ROPE_SCALING),
        moe_layers=(True,) * num_layers,
        sliding_windows=_sliding_windows(c, num_layers),
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        expert_activation=GatedActivation(
            "clamped_swiglu",
            alpha=float(c.get("swiglu_alpha", 1.702)),
            limit=float(c.get("swiglu_limit", 7.0)),
        ),
        expert_bias=True,
    )


ARCHITECTURE = Architecture(
    hf_names=("GptOssForCausalLM",),
    parse_config=parse_config,
    names=CheckpointNames(router="router", fused_experts=True),
)
