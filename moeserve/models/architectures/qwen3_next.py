"""Qwen3-Next and Qwen3.5-MoE: hybrid models whose layers are Gated DeltaNets (linear attention,
`layer_types` "linear_attention"; by default three of every four) and gated full attention.

Common to both: attention's q_proj gives each head's query and an output gate, per-head q/k
RMSNorm, a quarter of each head rotates (`partial_rotary_factor` 0.25 by default); every RMSNorm
but the DeltaNet's gated one scales by `1 + weight`; a softmax top-k router and a shared expert
scaled by sigmoid(shared_expert_gate(x)), as Qwen2-MoE.

Qwen3-Next (`Qwen3NextForCausalLM`): experts one tensor per expert and projection, dense MLPs on
`mlp_only_layers` and off the `decoder_sparse_step` grid, renormalised top-k only with
`norm_topk_prob`, the DeltaNet's projections grouped by key head (`in_proj_qkvz`, `in_proj_ba`).
Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, text model type `qwen3_5_moe_text`): every layer MoE, top-k
always renormalised, experts stacked per layer (`experts.gate_up_proj [E, 2I, H]`,
`experts.down_proj [E, H, I]`), split projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`). Its released multimodal checkpoints (`Qwen3_5MoeForConditionalGeneration`) keep the
text config under `text_config` and the weights under `model.language_model.`: the text model is
served, the vision tower is not read. Its rotary is multimodal (per-axis sections); for text the
three axes share each position, which is the plain rotary.

Both release one multi-token prediction layer (`num_nextn_predict_layers` or
`mtp_num_hidden_layers`) under `mtp.` (`CheckpointNames.mtp_layout` "qwen"): a full-attention MoE
decoder layer reading the target's hidden states after its final norm, as vLLM feeds them.
"""

from __future__ import annotations

from typing import Any

from moeserve.config import LinearAttentionConfig, ModelConfig, RouterConfig
from moeserve.models.architectures.base import Architecture, CheckpointNames, HFConfig
from moeserve.models.architectures.qwen_moe import moe_layers
from moeserve.models.checkpoint import CheckpointError

QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5_TEXT = "Qwen3_5MoeForCausalLM"
QWEN3_5_MULTIMODAL = "Qwen3_5MoeForConditionalGeneration"


def _layer_types(c: HFConfig, num_layers: int) -> tuple[bool, ...]:
    """Per layer: linear attention or not, from `layer_types`, else every `full_attention_interval`th
    layer full (transformers' default)."""
    types = c.get("layer_types", None)
    if types is None:
        interval = c.get("full_attention_interval", 4)
        return tuple(bool((i + 1) % interval) for i in range(num_layers))
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown or len(types) != num_layers:
        raise CheckpointError(
            f"config.json layer_types must be {num_layers} of linear_attention / full_attention, got {types}"
        )
    return tuple(t == "linear_attention" for t in types)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    c = HFConfig(raw)
    c.check_activation()
    next_ = c.architecture == QWEN3_NEXT
    num_layers = c.require("num_hidden_layers")
    num_experts = c.require("num_experts")
    head_dim = c.head_dim()
    num_k_heads = c.require("linear_num_key_heads")
    num_v_heads = c.require("linear_num_value_heads")
    if num_v_heads % num_k_heads:
        raise CheckpointError(
            f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads {num_k_heads}"
        )
    return c.model_config(
        intermediate_size=c.get("intermediate_size", 0),
        moe_intermediate_size=c.require("moe_intermediate_size"),
        num_experts=num_experts,
        router=RouterConfig(
            kind="softmax",
            top_k=c.require("num_experts_per_tok"),
            renormalize=bool(c.get("norm_topk_prob", True)) if next_ else True,
        ),
        rope=c.rope(c.rotary_dim(head_dim, default_factor=0.25)),
        moe_layers=moe_layers(c, num_layers, num_experts) if next_ else (True,) * num_layers,
        sliding_windows=(None,) * num_layers,
        shared_expert_intermediate_size=c.require("shared_expert_intermediate_size"),
        shared_expert_gated=True,
        qkv_bias=bool(c.get("attention_bias", False)),
        o_bias=bool(c.get("attention_bias", False)),
        qk_norm="head",
        linear_attention=LinearAttentionConfig(
            num_key_heads=num_k_heads,
            num_value_heads=num_v_heads,
            key_head_dim=c.require("linear_key_head_dim"),
            value_head_dim=c.require("linear_value_head_dim"),
            conv_kernel=c.require("linear_conv_kernel_dim"),
            grouped_projections=next_,
        ),
        linear_layers=_layer_types(c, num_layers),
        attention_output_gate=True,
        zero_centered_norms=True,
        num_mtp_layers=c.get("num_nextn_predict_layers", c.get("mtp_num_hidden_layers", 0)),
    )


QWEN3_NEXT_ARCHITECTURE = Architecture(
    hf_names=(QWEN3_NEXT,), parse_config=parse_config, names=CheckpointNames(mtp_layout="qwen")
)
QWEN3_5_ARCHITECTURE = Architecture(
    hf_names=(QWEN3_5_TEXT,),
    parse_config=parse_config,
    names=CheckpointNames(fused_experts=True, fused_layout="rows", mtp_layout="qwen"),
)
QWEN3_5_MULTIMODAL_ARCHITECTURE = Architecture(
    hf_names=(QWEN3_5_MULTIMODAL,),
    parse_config=parse_config,
    names=CheckpointNames(
        fused_experts=True, fused_layout="rows", model_prefix="model.language_model.", mtp_layout="qwen"
    ),
    text_config=True,
)
ARCHITECTURES = (QWEN3_NEXT_ARCHITECTURE, QWEN3_5_ARCHITECTURE, QWEN3_5_MULTIMODAL_ARCHITECTURE)
