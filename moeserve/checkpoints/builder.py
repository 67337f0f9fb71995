"""Tiny, randomly initialised Hugging Face MoE checkpoints, made locally.

Why: tests, parity checks and the demo server need real checkpoints, in exactly the layout of
those on the hub (``config.json``; safetensors, sharded with ``model.safetensors.index.json``
above a size; ``generation_config.json``; tokenizer), without downloading gigabytes. The model
is built by transformers itself and written by its ``save_pretrained``, so the layout is HF's own
and not our imitation of it. With transformers 5.x the experts live fused in memory but are saved
one tensor per expert, as the hub checkpoints are: ``block_sparse_moe.experts.E.w1/w2/w3`` for
Mixtral, ``mlp.experts.E.{gate,up,down}_proj`` for the others.

Two departures from HF's own random init, both so that the tiny models test something:
- ``init_std`` defaults to 0.2, not HF's 0.02. At 0.02 the logits of a 2-layer model are nearly
  flat (std ~0.15) and greedy decoding often falls into one repeated token; at 0.2 greedy text
  is varied, next-token distributions are peaked enough for sampling settings to matter, and the
  router spreads tokens over the experts.
- The correction bias of sigmoid routers (DeepSeek-V3, GLM-4.5, MiniMax-M2; zero in HF's init)
  gets small random float32 values, and so do gpt-oss's expert biases, else those paths would
  go untested.

With ``quantize="fp8"`` the saved weights are then rewritten as the FP8 releases lay them out
(``quantize_fp8.py``), with ``quantize="mxfp4"`` gpt-oss's experts as its MXFP4 release lays
them out (``quantize_mxfp4.py``), with ``quantize="int4"`` / ``"nvfp4"`` the routed experts as
Kimi-K2.5's INT4 and ModelOpt's NVFP4 releases store them (``quantize_int4.py``, ``quantize_nvfp4.py``).

gpt-oss is saved as transformers lays out its bf16 form: a layer's experts in four stacked
tensors (``mlp.experts.gate_up_proj`` and ``down_proj`` with their biases), not one per expert.
"""

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV32Config,
    GenerationConfig,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    GptOssConfig,
    MiniMaxM2Config,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from moeserve.checkpoints import quantize_fp8, quantize_int4, quantize_mxfp4, quantize_nvfp4
from moeserve.checkpoints.mtp import write_mtp_layers
from moeserve.checkpoints.spec import HYBRID_ARCHS, SUPPORTED_ARCHS, MakeModelSpec
from moeserve.checkpoints.tokenizer import BOS_ID, EOS_ID, HARMONY_IDS, IM_END_ID, PAD_ID, train_tokenizer

logger = logging.getLogger("moeserve.checkpoints")

__all__ = ["SUPPORTED_ARCHS", "MakeModelSpec", "make_model"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CORRECTION_BIAS_STD = 0.05  # flips the choice of some, not all, tokens' experts (sigmoid scores)
_EXPERT_BIAS_STD = 0.1  # gpt-oss's expert biases: of the order of its projections' outputs at init
_ZERO_CENTRED_NORM_STD = 0.2  # Qwen3-Next's norms scale by 1 + w: spreads their scales over about 0.8-1.2
_LINEAR_CONV_KERNEL = 4  # the DeltaNets' causal convolution, as released
_DSA_INDEX_HEADS = 16  # enough that no two keys tie at an indexer score of exactly 0 (every head's ReLU zero)
_DSA_INDEX_TOPK = 16  # keys each query attends to: prompts longer than this exercise the sparse path


def make_model(spec: MakeModelSpec, out_dir: Path) -> Path:
    """Build the model ``spec`` describes, with its tokenizer, into ``out_dir``; return it.

    ``out_dir`` must be missing or empty, so no file of an older model can linger beside the new
    one. The same spec always gives the same weights (the seed is applied to a forked RNG, so
    the caller's torch RNG is left as it was).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty")
    config = _ARCH_CONFIGS[spec.arch](spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=_TORCH_DTYPES[spec.dtype])
        _randomise_correction_bias(model)
        _randomise_expert_biases(model)
        if spec.arch in HYBRID_ARCHS:
            _randomise_zero_centred_norms(model)
    model.generation_config = _generation_config(spec)
    model.save_pretrained(out_dir, max_shard_size=spec.max_shard_bytes)
    if spec.mtp_layers:
        write_mtp_layers(spec, _ARCH_CONFIGS[spec.arch], out_dir)
    if spec.quantize == "fp8":
        quantize_fp8.quantize_checkpoint(out_dir)
    elif spec.quantize == "mxfp4":
        quantize_mxfp4.quantize_checkpoint(out_dir)
    elif spec.quantize == "int4":
        quantize_int4.quantize_checkpoint(out_dir)
    elif spec.quantize == "nvfp4":
        quantize_nvfp4.quantize_checkpoint(out_dir)
    train_tokenizer(spec.vocab, out_dir, model_max_length=spec.max_position_embeddings, chat_format=spec.chat_format)
    logger.info("made %s model (%s) in %s", spec.arch, _describe(spec), out_dir)
    return out_dir


def _describe(spec: MakeModelSpec) -> str:
    """The spec's non-default fields, for the log."""
    defaults = MakeModelSpec(arch=spec.arch)
    changed = [
        f"{f.name}={getattr(spec, f.name)}"
        for f in dataclasses.fields(spec)
        if f.name != "arch" and getattr(spec, f.name) != getattr(defaults, f.name)
    ]
    return ", ".join(changed) or "defaults"


def _randomise_expert_biases(model: PreTrainedModel) -> None:
    """Give gpt-oss's expert biases (zero in HF's init) small random values, in the model's dtype."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                param.copy_(torch.randn(param.shape) * _EXPERT_BIAS_STD)


def _randomise_zero_centred_norms(model: PreTrainedModel) -> None:
    """Draw the hybrid models' zero-centred RMSNorm weights (zero in HF's init, a scale of 1 + w)
    at random, so that a loader which forgot the ``1 +``, or added it to the DeltaNet's gated norm
    (a plain scale), gives other logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and not param.any():
                param.normal_(0.0, _ZERO_CENTRED_NORM_STD)


def _randomise_correction_bias(model: PreTrainedModel) -> None:
    """Give every sigmoid router's ``e_score_correction_bias`` small random float32 values.

    Random, so that the bias changes which experts some tokens get (about a fifth of them at the
    default sizes). Float32 whatever the model's dtype, as in DeepSeek's own checkpoints, so
    loaders meet a checkpoint of mixed dtypes (HF would otherwise save it in the model's dtype).
    """
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = torch.randn(bias.shape) * _CORRECTION_BIAS_STD


def _generation_config(spec: MakeModelSpec) -> GenerationConfig:
    """Greedy by default; stop at ``</s>`` or where a chat turn ends: ChatML's ``<|im_end|>``, or
    harmony's ``<|return|>`` and ``<|call|>`` (gpt-oss's own stop tokens)."""
    if spec.chat_format == "harmony":
        eos = [HARMONY_IDS["<|return|>"], EOS_ID, HARMONY_IDS["<|call|>"]]
    else:
        eos = [EOS_ID, IM_END_ID]
    return GenerationConfig(bos_token_id=BOS_ID, eos_token_id=eos, pad_token_id=PAD_ID, do_sample=False)


def _common_config(spec: MakeModelSpec, architecture: str) -> dict[str, object]:
    """Config fields that every architecture names the same way."""
    return {
        "architectures": [architecture],
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_experts_per_tok": spec.top_k,
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def _mixtral_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """Mixtral: every layer MoE, softmax router, experts sized by ``intermediate_size``."""
    return MixtralConfig(
        **_common_config(spec, "MixtralForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.expert_intermediate,
        num_local_experts=spec.experts,
    )


def _qwen2_moe_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """Qwen2-MoE: QKV bias, a gated shared expert, top-k weights not renormalised (as Qwen1.5)."""
    return Qwen2MoeConfig(
        **_common_config(spec, "Qwen2MoeForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.dense_intermediate,
        moe_intermediate_size=spec.expert_intermediate,
        shared_expert_intermediate_size=spec.shared_intermediate,
        num_experts=spec.experts,
        norm_topk_prob=False,
    )


def _qwen3_moe_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """Qwen3-MoE: q/k RMSNorm, no shared expert, top-k weights renormalised (as Qwen3-30B-A3B)."""
    return Qwen3MoeConfig(
        **_common_config(spec, "Qwen3MoeForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.dense_intermediate,
        moe_intermediate_size=spec.expert_intermediate,
        num_experts=spec.experts,
        norm_topk_prob=True,
    )


def _deepseek_v3_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """DeepSeek-V3. No multi-token-prediction layer: HF neither builds nor saves one, so the
    config says 0 rather than HF's default 1."""
    return DeepseekV3Config(**_mla_config(spec, "DeepseekV3ForCausalLM"), num_mtp_layers=0)


def _olmoe_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """OLMoE: q/k norms over the whole projections, softmax top-k not renormalised (as released);
    experts sized by ``intermediate_size``, head size hidden / heads."""
    return OlmoeConfig(
        **_common_config(spec, "OlmoeForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.expert_intermediate,
        num_experts=spec.experts,
        norm_topk_prob=False,
    )


def _glm4_moe_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """GLM-4.5: DeepSeek-V3's router, dense first layers and shared experts on GQA attention with
    q/k/v biases, per-head q/k norm and rotary over half of each head (as GLM-4.5 and 4.6)."""
    return Glm4MoeConfig(
        **_common_config(spec, "Glm4MoeForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.dense_intermediate,
        moe_intermediate_size=spec.expert_intermediate,
        n_routed_experts=spec.experts,
        n_shared_experts=spec.n_shared_experts,
        routed_scaling_factor=spec.routed_scaling_factor,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        first_k_dense_replace=spec.first_k_dense_replace,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        partial_rotary_factor=0.5,
        num_mtp_layers=0,
    )


def _minimax_m2_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """MiniMax-M2: sigmoid router with a correction bias, q/k norms over the whole projections,
    rotary over half of each head (the released ``rotary_dim`` 64 of 128)."""
    return MiniMaxM2Config(
        **_common_config(spec, "MiniMaxM2ForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.expert_intermediate,
        num_local_experts=spec.experts,
        rotary_dim=spec.head_dim // 2,
    )


def _gpt_oss_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """gpt-oss: attention sinks, alternating sliding (128) and full layers, YaRN, biased experts
    with the clamped SwiGLU; transformers' defaults for all of these."""
    return GptOssConfig(
        **_common_config(spec, "GptOssForCausalLM"),
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.expert_intermediate,
        num_local_experts=spec.experts,
    )


def _hybrid_layer_types(layers: int) -> list[str]:
    """Three DeltaNets then one full attention, as released, with the interval shortened to the
    layer count below 4 so that a model of 2 or more layers has both kinds (its last layer is full
    attention); a 1-layer model is that one full-attention layer."""
    interval = min(4, layers)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _hybrid_config(spec: MakeModelSpec) -> dict[str, object]:
    """What Qwen3-Next and Qwen3.5-MoE share: GQA gated attention beside Gated DeltaNets sized from
    the attention's heads (``kv_heads`` key heads, ``heads`` value heads, ``head_dim`` wide), a
    softmax router and a gated shared expert."""
    return {
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "moe_intermediate_size": spec.expert_intermediate,
        "shared_expert_intermediate_size": spec.shared_intermediate,
        "num_experts": spec.experts,
        "layer_types": _hybrid_layer_types(spec.layers),
        "linear_num_key_heads": spec.kv_heads,
        "linear_num_value_heads": spec.heads,
        "linear_key_head_dim": spec.head_dim,
        "linear_value_head_dim": spec.head_dim,
        "linear_conv_kernel_dim": _LINEAR_CONV_KERNEL,
    }


def _qwen3_next_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """Qwen3-Next: hybrid layers, experts one tensor per expert, every layer MoE, top-k weights
    renormalised (as Qwen3-Next-80B-A3B). No MTP layer: transformers builds none."""
    return Qwen3NextConfig(
        **_common_config(spec, "Qwen3NextForCausalLM"),
        **_hybrid_config(spec),
        intermediate_size=spec.dense_intermediate,
        norm_topk_prob=True,
    )


def _qwen3_5_moe_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """Qwen3.5-MoE's text model (``Qwen3_5MoeForCausalLM``), what the server serves of the
    multimodal release: hybrid layers, experts one tensor per expert as transformers saves them
    (the release stacks them per layer; the server reads both), no dense MLP."""
    return Qwen3_5MoeTextConfig(**_common_config(spec, "Qwen3_5MoeForCausalLM"), **_hybrid_config(spec))


def _mla_config(spec: MakeModelSpec, architecture: str) -> dict[str, object]:
    """DeepSeek-V3's fields, which its sparse-attention successors keep: MLA attention, sigmoid
    group-limited router with a correction bias, shared experts, dense first layers."""
    return {
        **_common_config(spec, architecture),
        "num_key_value_heads": spec.heads,  # MLA; HF's default (128) would be wrong here
        "intermediate_size": spec.dense_intermediate,
        "moe_intermediate_size": spec.expert_intermediate,
        "n_routed_experts": spec.experts,
        "n_shared_experts": spec.n_shared_experts,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "n_group": spec.n_group,
        "topk_group": spec.topk_group,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "norm_topk_prob": True,
    }


def _dsa_config(spec: MakeModelSpec) -> dict[str, object]:
    """DeepSeek Sparse Attention's indexer: its heads twice as wide as the rotary part they
    rotate (as V3.2's 128 over 64), every layer scoring its own top-k."""
    return {
        "index_n_heads": _DSA_INDEX_HEADS,
        "index_head_dim": 2 * spec.qk_rope_head_dim,
        "index_topk": _DSA_INDEX_TOPK,
    }


def _deepseek_v32_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention on every layer."""
    return DeepseekV32Config(**_mla_config(spec, "DeepseekV32ForCausalLM"), **_dsa_config(spec))


def _glm_moe_dsa_config(spec: MakeModelSpec) -> PreTrainedConfig:
    """GLM-5: DeepSeek-V3.2's layout with an interleaved indexer rotary; transformers' default
    indexer schedule, in which every layer of a model this small runs its own indexer."""
    return GlmMoeDsaConfig(**_mla_config(spec, "GlmMoeDsaForCausalLM"), **_dsa_config(spec))


_ARCH_CONFIGS: dict[str, Callable[[MakeModelSpec], PreTrainedConfig]] = {
    "mixtral": _mixtral_config,
    "qwen2_moe": _qwen2_moe_config,
    "qwen3_moe": _qwen3_moe_config,
    "deepseek_v3": _deepseek_v3_config,
    "olmoe": _olmoe_config,
    "glm4_moe": _glm4_moe_config,
    "minimax_m2": _minimax_m2_config,
    "gpt_oss": _gpt_oss_config,
    "qwen3_next": _qwen3_next_config,
    "qwen3_5_moe": _qwen3_5_moe_config,
    "deepseek_v32": _deepseek_v32_config,
    "glm_moe_dsa": _glm_moe_dsa_config,
}
