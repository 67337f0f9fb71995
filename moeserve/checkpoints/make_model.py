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
- DeepSeek-V3's ``e_score_correction_bias`` (zero in HF's init) gets small random float32 values,
  else the bias path of its router would go untested.
"""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GenerationConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from moeserve.checkpoints.tokenizer import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    MIN_VOCAB_SIZE,
    PAD_ID,
    train_tokenizer,
)

logger = logging.getLogger("moeserve.checkpoints")

Arch = Literal["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
DType = Literal["float32", "bfloat16", "float16"]
SUPPORTED_ARCHS: tuple[str, ...] = get_args(Arch)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CORRECTION_BIAS_STD = 0.05  # flips the choice of some, not all, tokens' experts (sigmoid scores)


@dataclass(frozen=True)
class MakeModelSpec:
    """What to build. The defaults give a model that builds and runs in well under a second.

    Fields that belong to one architecture are ignored by the others, except where a value would
    mean something the architecture cannot do (``__post_init__`` says so with a ``ValueError``).
    """

    arch: Arch
    """Architecture: mixtral, qwen2_moe, qwen3_moe or deepseek_v3."""
    layers: int = 2
    """Decoder layers."""
    hidden: int = 64
    """Hidden size."""
    experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    vocab: int = 512
    """Vocabulary size, of the tokenizer and the embeddings alike."""
    heads: int = 4
    """Attention heads."""
    kv_heads: int = 2
    """Key/value heads (GQA). Ignored by deepseek_v3, whose MLA has one per query head."""
    head_dim: int = 16
    """Attention head size. Ignored by deepseek_v3, which has the qk_*/v_head_dim fields."""
    intermediate: int | None = None
    """Dense MLP size (deepseek_v3's first layers; qwen writes it but uses it nowhere);
    default 2*hidden. Mixtral has no dense MLP."""
    moe_intermediate: int | None = None
    """One expert's MLP size; default hidden/2, unlike hidden so a transposed weight fails."""
    shared_expert_intermediate: int | None = None
    """qwen2_moe only: the shared expert's MLP size; default 4*moe_intermediate (Qwen1.5-MoE)."""
    q_lora_rank: int = 32
    """deepseek_v3: low-rank size of the query projection; 0 for a plain q_proj (V2-Lite)."""
    kv_lora_rank: int = 32
    """deepseek_v3: size of the compressed KV latent (what its KV cache holds)."""
    qk_rope_head_dim: int = 8
    """deepseek_v3: rotary part of a query/key head."""
    qk_nope_head_dim: int = 16
    """deepseek_v3: non-rotary part of a query/key head."""
    v_head_dim: int = 16
    """deepseek_v3: value head size."""
    n_group: int = 4
    """deepseek_v3: expert groups for group-limited routing (V3: 8 groups of 32)."""
    topk_group: int = 2
    """deepseek_v3: groups each token may take experts from (V3: 4 of 8)."""
    first_k_dense_replace: int = 1
    """deepseek_v3: leading layers with a dense MLP instead of MoE."""
    n_shared_experts: int = 1
    """deepseek_v3: shared experts, which every token goes through."""
    routed_scaling_factor: float = 2.5
    """deepseek_v3: scale of the routed experts' weights (V3's value)."""
    init_std: float = 0.2
    """Std of the random init; HF's 0.02 leaves tiny models' greedy text repeating one token."""
    seed: int = 0
    """Torch seed: the same spec gives the same weights, byte for byte."""
    dtype: DType = "float32"
    """Dtype of the saved weights: float32, bfloat16 or float16."""
    max_position_embeddings: int = 2048
    """Longest sequence; also the tokenizer's model_max_length."""
    max_shard_bytes: int = 1 << 30
    """Largest safetensors file; above it HF writes shards and model.safetensors.index.json."""

    def __post_init__(self) -> None:
        _check_common(self)
        if self.arch == "deepseek_v3":
            _check_deepseek(self)
        else:
            _check_gqa(self)

    @property
    def dense_intermediate(self) -> int:
        """The dense MLP size, with its default applied."""
        return self.intermediate if self.intermediate is not None else 2 * self.hidden

    @property
    def expert_intermediate(self) -> int:
        """One expert's MLP size, with its default applied (differs from ``hidden`` so that a
        transposed weight cannot go unnoticed)."""
        return self.moe_intermediate if self.moe_intermediate is not None else self.hidden // 2

    @property
    def shared_intermediate(self) -> int:
        """qwen2_moe's shared expert size, with its default applied (as in Qwen1.5-MoE: 4x)."""
        if self.shared_expert_intermediate is not None:
            return self.shared_expert_intermediate
        return 4 * self.expert_intermediate


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_common(spec: MakeModelSpec) -> None:
    _require(spec.arch in SUPPORTED_ARCHS,
             f"arch={spec.arch!r}: expected one of {SUPPORTED_ARCHS}")
    _require(spec.dtype in _TORCH_DTYPES,
             f"dtype={spec.dtype!r}: expected one of {tuple(_TORCH_DTYPES)}")
    for name in ("layers", "hidden", "experts", "top_k", "heads", "max_position_embeddings",
                 "max_shard_bytes"):
        _require(getattr(spec, name) > 0, f"{name}={getattr(spec, name)} must be positive")
    for name in ("intermediate", "moe_intermediate", "shared_expert_intermediate"):
        value = getattr(spec, name)
        _require(value is None or value > 0, f"{name}={value} must be positive")
    _require(spec.hidden >= 2, f"hidden={spec.hidden} must be at least 2")
    _require(spec.top_k <= spec.experts, f"top_k={spec.top_k} exceeds experts={spec.experts}")
    _require(spec.vocab >= MIN_VOCAB_SIZE,
             f"vocab={spec.vocab}: a byte-level tokenizer needs at least {MIN_VOCAB_SIZE}")
    _require(spec.init_std > 0, f"init_std={spec.init_std} must be positive")
    _require(spec.arch != "mixtral" or spec.intermediate is None,
             "mixtral has no dense MLP: set moe_intermediate, not intermediate")
    _require(spec.arch == "qwen2_moe" or spec.shared_expert_intermediate is None,
             "shared_expert_intermediate applies to qwen2_moe only")


def _check_gqa(spec: MakeModelSpec) -> None:
    """Checks for the archs with grouped-query attention (all but deepseek_v3)."""
    _require(spec.kv_heads > 0, f"kv_heads={spec.kv_heads} must be positive")
    _require(spec.heads % spec.kv_heads == 0,
             f"heads={spec.heads} is not a multiple of kv_heads={spec.kv_heads}")
    _require(spec.head_dim > 0 and spec.head_dim % 2 == 0,
             f"head_dim={spec.head_dim} must be positive and even (rotary embeddings rotate pairs)")


def _check_deepseek(spec: MakeModelSpec) -> None:
    """Checks for DeepSeek-V3: MLA sizes and group-limited routing."""
    # n_shared_experts too: HF's DeepseekV3 always builds them, and with 0 saves empty tensors.
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
                 "n_shared_experts"):
        _require(getattr(spec, name) > 0, f"{name}={getattr(spec, name)} must be positive")
    _require(spec.q_lora_rank >= 0,
             f"q_lora_rank={spec.q_lora_rank} must be positive, or 0 for none")
    _require(spec.qk_rope_head_dim > 0 and spec.qk_rope_head_dim % 2 == 0,
             f"qk_rope_head_dim={spec.qk_rope_head_dim} must be positive and even")
    _require(spec.experts % spec.n_group == 0,
             f"experts={spec.experts} is not divisible by n_group={spec.n_group}")
    per_group = spec.experts // spec.n_group
    # The router scores a group by the sum of its two best experts.
    _require(per_group >= 2, f"n_group={spec.n_group} leaves fewer than 2 experts per group")
    _require(spec.topk_group <= spec.n_group,
             f"topk_group={spec.topk_group} exceeds n_group={spec.n_group}")
    _require(spec.top_k <= spec.topk_group * per_group,
             f"top_k={spec.top_k} exceeds the {spec.topk_group * per_group} experts in "
             f"topk_group={spec.topk_group} groups")
    _require(0 <= spec.first_k_dense_replace < spec.layers,
             f"first_k_dense_replace={spec.first_k_dense_replace} leaves no MoE layer "
             f"among layers={spec.layers}")


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
        if spec.arch == "deepseek_v3":
            _randomise_correction_bias(model)
    model.generation_config = _generation_config()
    model.save_pretrained(out_dir, max_shard_size=spec.max_shard_bytes)
    train_tokenizer(spec.vocab, out_dir, model_max_length=spec.max_position_embeddings)
    logger.info("made %s model (%s) in %s", spec.arch, _describe(spec), out_dir)
    return out_dir


def _describe(spec: MakeModelSpec) -> str:
    """The spec's non-default fields, for the log."""
    defaults = MakeModelSpec(arch=spec.arch)
    changed = [f"{f.name}={getattr(spec, f.name)}" for f in dataclasses.fields(spec)
               if f.name != "arch" and getattr(spec, f.name) != getattr(defaults, f.name)]
    return ", ".join(changed) or "defaults"


def _randomise_correction_bias(model: PreTrainedModel) -> None:
    """Give every DeepSeek router's ``e_score_correction_bias`` small random float32 values.

    Random, so that the bias changes which experts some tokens get (about a fifth of them at the
    default sizes). Float32 whatever the model's dtype, as in DeepSeek's own checkpoints, so
    loaders meet a checkpoint of mixed dtypes (HF would otherwise save it in the model's dtype).
    """
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            module.e_score_correction_bias = torch.randn(bias.shape) * _CORRECTION_BIAS_STD


def _generation_config() -> GenerationConfig:
    """Greedy by default; stop at ``</s>`` or at ChatML's ``<|im_end|>`` (ending a chat turn)."""
    return GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID, do_sample=False
    )


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
    """DeepSeek-V3: MLA attention, sigmoid group-limited router with a correction bias, shared
    experts, dense first layers. No multi-token-prediction layer: HF neither builds nor saves
    one, so the config says 0 rather than HF's default 1."""
    return DeepseekV3Config(
        **_common_config(spec, "DeepseekV3ForCausalLM"),
        num_key_value_heads=spec.heads,  # MLA; HF's default (128) would be wrong here
        intermediate_size=spec.dense_intermediate,
        moe_intermediate_size=spec.expert_intermediate,
        n_routed_experts=spec.experts,
        n_shared_experts=spec.n_shared_experts,
        routed_scaling_factor=spec.routed_scaling_factor,
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        first_k_dense_replace=spec.first_k_dense_replace,
        norm_topk_prob=True,
        num_mtp_layers=0,
    )


_ARCH_CONFIGS: dict[str, Callable[[MakeModelSpec], PreTrainedConfig]] = {
    "mixtral": _mixtral_config,
    "qwen2_moe": _qwen2_moe_config,
    "qwen3_moe": _qwen3_moe_config,
    "deepseek_v3": _deepseek_v3_config,
}
