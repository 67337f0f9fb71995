"""What `make_model` builds: the spec of a tiny checkpoint and its checks.

Apart from `builder.py` so that `moeserve make-model`'s flags, generated from the spec's
fields, can be listed without importing torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from moeserve.checkpoints.tokenizer import HARMONY_TOKENS, MIN_VOCAB_SIZE

Arch = Literal[
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "olmoe",
    "glm4_moe",
    "minimax_m2",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v32",
    "glm_moe_dsa",
]
DType = Literal["float32", "bfloat16", "float16"]
Quantize = Literal["none", "fp8", "mxfp4", "int4", "nvfp4"]
# Architectures whose routed experts are per-expert gate_proj/up_proj/down_proj tensors, as the
# INT4 (compressed-tensors) and NVFP4 (ModelOpt) releases store them.
PACKED_EXPERT_ARCHS = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "glm4_moe", "olmoe")
ChatFormat = Literal["chatml", "harmony"]
MTPInit = Literal["random", "aligned"]
SUPPORTED_ARCHS: tuple[str, ...] = get_args(Arch)
SUPPORTED_DTYPES: tuple[str, ...] = get_args(DType)
MLA_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # DeepSeek's multi-head latent attention
DSA_ARCHS = ("deepseek_v32", "glm_moe_dsa")  # MLA with DeepSeek Sparse Attention's indexer
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe")  # Gated DeltaNet layers between full-attention ones
MTP_ARCHS = ("deepseek_v3", "glm4_moe", *HYBRID_ARCHS, *DSA_ARCHS)  # released with MTP layers
# group-limited routing, dense first layers, shared experts
GROUPED_ROUTER_ARCHS = ("glm4_moe", *MLA_ARCHS)
# every layer MoE, experts sized alone
NO_DENSE_MLP_ARCHS = ("mixtral", "olmoe", "minimax_m2", "gpt_oss", "qwen3_5_moe")


@dataclass(frozen=True)
class MakeModelSpec:
    """What to build. The defaults give a model that builds and runs in well under a second.

    Fields that belong to one architecture are ignored by the others, except where a value would
    mean something the architecture cannot do (``__post_init__`` says so with a ``ValueError``).
    """

    arch: Arch
    """Architecture: mixtral, qwen2_moe, qwen3_moe, deepseek_v3, olmoe, glm4_moe, minimax_m2, gpt_oss,
    qwen3_next (Qwen3-Next), qwen3_5_moe (Qwen3.5-MoE's text model), deepseek_v32 (DeepSeek-V3.2)
    or glm_moe_dsa (GLM-5)."""
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
    """Key/value heads (GQA). Ignored by the MLA archs (deepseek_v3, deepseek_v32, glm_moe_dsa),
    which have one per query head. qwen3_next and qwen3_5_moe give their DeltaNets as many key
    heads (and ``heads`` value heads)."""
    head_dim: int = 16
    """Attention head size, and the DeltaNets' key and value head size (qwen3_next, qwen3_5_moe).
    Ignored by the MLA archs, which have the qk_*/v_head_dim fields; olmoe needs
    heads * head_dim == hidden (its q/k norms are sized from hidden)."""
    intermediate: int | None = None
    """Dense MLP size (the first layers of deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa; qwen2_moe,
    qwen3_moe and qwen3_next write it but use it nowhere); default 2*hidden. mixtral, olmoe,
    minimax_m2, gpt_oss and qwen3_5_moe have no dense MLP."""
    moe_intermediate: int | None = None
    """One expert's MLP size; default hidden/2, unlike hidden so a transposed weight fails."""
    shared_expert_intermediate: int | None = None
    """qwen2_moe, qwen3_next, qwen3_5_moe: the shared expert's MLP size; default
    4*moe_intermediate (Qwen1.5-MoE)."""
    q_lora_rank: int = 32
    """MLA archs: low-rank size of the query projection; 0 for a plain q_proj (V2-Lite), which
    deepseek_v32 and glm_moe_dsa cannot have (their indexer reads the query latent)."""
    kv_lora_rank: int = 32
    """MLA archs: size of the compressed KV latent (what its KV cache holds)."""
    qk_rope_head_dim: int = 8
    """MLA archs: rotary part of a query/key head; the DSA indexer's heads are twice as wide."""
    qk_nope_head_dim: int = 16
    """MLA archs: non-rotary part of a query/key head."""
    v_head_dim: int = 16
    """MLA archs: value head size."""
    n_group: int = 4
    """Grouped-router archs (deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa): expert groups for
    group-limited routing (V3: 8 groups of 32)."""
    topk_group: int = 2
    """Grouped-router archs: groups each token may take experts from (V3: 4 of 8)."""
    first_k_dense_replace: int = 1
    """Grouped-router archs: leading layers with a dense MLP instead of MoE."""
    n_shared_experts: int = 1
    """Grouped-router archs: shared experts, which every token goes through."""
    routed_scaling_factor: float = 2.5
    """Grouped-router archs: scale of the routed experts' weights (V3's value)."""
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
    mtp_layers: int = 0
    """Multi-token prediction layers, as the releases store them; speculative decoding's mtp
    drafts. deepseek_v3, glm4_moe, deepseek_v32, glm_moe_dsa: decoder layers after the last
    (`num_nextn_predict_layers`); qwen3_next, qwen3_5_moe: one layer under `mtp.`, the most the
    server drafts with for them."""
    mtp_init: MTPInit = "random"
    """How the MTP layers are made: random, or aligned (built to agree with the target often:
    see `checkpoints/mtp.py`)."""
    quantize: Quantize = "none"
    """fp8: linear weights saved as FP8 with a float32 scale per 128x128 block, as DeepSeek-V3
    and Qwen3-FP8 are published (embeddings, LM head, norms and routers stay in dtype). mxfp4
    (gpt_oss only): the experts saved as FP4 codes with a power-of-two scale per 32 values, as
    gpt-oss-20b/120b are published (expert biases in bf16, the rest in dtype). int4: the routed
    experts as compressed-tensors pack-quantized INT4 in groups of 32, as Kimi-K2-Thinking/K2.5
    are published; nvfp4: as ModelOpt's NVFP4 releases (hf_quant_config.json); both keep the rest
    in bf16."""
    chat_format: ChatFormat = "chatml"
    """harmony (gpt_oss only): the tokenizer carries harmony's markers as special tokens and
    generation stops at ``<|return|>`` and ``<|call|>``, as gpt-oss's do, so the server speaks
    harmony to it; chatml: a ChatML template, as every other family's."""

    def __post_init__(self) -> None:
        _check_common(self)
        if self.arch in MLA_ARCHS:
            _check_deepseek(self)
        else:
            _check_gqa(self)
        if self.arch in GROUPED_ROUTER_ARCHS:
            _check_grouped_router(self)

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
    _require(spec.arch in SUPPORTED_ARCHS, f"arch={spec.arch!r}: expected one of {SUPPORTED_ARCHS}")
    _require(spec.dtype in SUPPORTED_DTYPES, f"dtype={spec.dtype!r}: expected one of {SUPPORTED_DTYPES}")
    for name in ("layers", "hidden", "experts", "top_k", "heads", "max_position_embeddings", "max_shard_bytes"):
        _require(getattr(spec, name) > 0, f"{name}={getattr(spec, name)} must be positive")
    for name in ("intermediate", "moe_intermediate", "shared_expert_intermediate"):
        value = getattr(spec, name)
        _require(value is None or value > 0, f"{name}={value} must be positive")
    _require(spec.hidden >= 2, f"hidden={spec.hidden} must be at least 2")
    _require(spec.top_k <= spec.experts, f"top_k={spec.top_k} exceeds experts={spec.experts}")
    _require(
        spec.vocab >= MIN_VOCAB_SIZE, f"vocab={spec.vocab}: a byte-level tokenizer needs at least {MIN_VOCAB_SIZE}"
    )
    _require(spec.quantize in get_args(Quantize), f"quantize={spec.quantize!r}: expected one of {get_args(Quantize)}")
    _require(
        spec.quantize != "fp8" or spec.arch != "gpt_oss",
        "gpt_oss is published with MXFP4 experts, not FP8: use quantize=mxfp4 for it",
    )
    _require(
        spec.quantize != "mxfp4" or spec.arch == "gpt_oss",
        f"quantize=mxfp4 is gpt_oss's expert format (as transformers reads it), not {spec.arch}'s: use fp8",
    )
    _require(
        spec.quantize != "mxfp4" or (spec.hidden % 32 == 0 and spec.expert_intermediate % 32 == 0),
        f"quantize=mxfp4 cuts expert rows into blocks of 32: hidden={spec.hidden} and "
        f"moe_intermediate={spec.expert_intermediate} must be multiples of 32",
    )
    packed = {"int4": 32, "nvfp4": 16}.get(spec.quantize)
    _require(
        packed is None or spec.arch in PACKED_EXPERT_ARCHS,
        f"quantize={spec.quantize!r} writes per-expert gate/up/down projections: {', '.join(PACKED_EXPERT_ARCHS)}, "
        f"not {spec.arch}",
    )
    _require(
        packed is None or (spec.hidden % packed == 0 and spec.expert_intermediate % packed == 0),
        f"quantize={spec.quantize} cuts expert rows into groups of {packed}: hidden={spec.hidden} and "
        f"moe_intermediate={spec.expert_intermediate} must be multiples of {packed}",
    )
    _require(spec.init_std > 0, f"init_std={spec.init_std} must be positive")
    _require(spec.mtp_layers >= 0, f"mtp_layers={spec.mtp_layers} must be >= 0")
    _require(
        spec.mtp_layers == 0 or spec.arch in MTP_ARCHS,
        f"mtp_layers: {spec.arch} has no multi-token prediction layers ({', '.join(MTP_ARCHS)} do)",
    )
    _require(
        spec.mtp_layers <= 1 or spec.arch not in HYBRID_ARCHS,
        f"mtp_layers={spec.mtp_layers}: the server drafts with one MTP layer of {spec.arch}'s (one fc feeding "
        "more is not built), as the releases have",
    )
    _require(spec.mtp_layers == 0 or spec.quantize == "none", "mtp_layers are written unquantized only")
    _require(
        spec.chat_format in get_args(ChatFormat),
        f"chat_format={spec.chat_format!r}: expected one of {get_args(ChatFormat)}",
    )
    _require(spec.chat_format != "harmony" or spec.arch == "gpt_oss", "chat_format=harmony is gpt_oss's format only")
    _require(
        spec.chat_format != "harmony" or spec.vocab >= MIN_VOCAB_SIZE + len(HARMONY_TOKENS),
        f"vocab={spec.vocab}: harmony's markers need at least {MIN_VOCAB_SIZE + len(HARMONY_TOKENS)}",
    )
    _require(
        spec.arch not in NO_DENSE_MLP_ARCHS or spec.intermediate is None,
        f"{spec.arch} has no dense MLP: set moe_intermediate, not intermediate",
    )
    _require(
        spec.arch in ("qwen2_moe", *HYBRID_ARCHS) or spec.shared_expert_intermediate is None,
        f"shared_expert_intermediate applies to qwen2_moe, {' and '.join(HYBRID_ARCHS)} only",
    )


def _check_gqa(spec: MakeModelSpec) -> None:
    """Checks for the archs with grouped-query attention (all but the MLA ones)."""
    _require(spec.kv_heads > 0, f"kv_heads={spec.kv_heads} must be positive")
    _require(spec.heads % spec.kv_heads == 0, f"heads={spec.heads} is not a multiple of kv_heads={spec.kv_heads}")
    _require(
        spec.head_dim > 0 and spec.head_dim % 2 == 0,
        f"head_dim={spec.head_dim} must be positive and even (rotary embeddings rotate pairs)",
    )
    _require(
        spec.arch not in ("glm4_moe", "minimax_m2") or spec.head_dim % 4 == 0,
        f"head_dim={spec.head_dim}: {spec.arch} rotates half of each head, so it must be a multiple of 4",
    )
    _require(
        spec.arch not in HYBRID_ARCHS or spec.head_dim % 8 == 0,
        f"head_dim={spec.head_dim}: {spec.arch} rotates a quarter of each head, so it must be a multiple of 8",
    )
    _require(
        spec.arch != "olmoe" or spec.heads * spec.head_dim == spec.hidden,
        f"olmoe sizes its q/k norms from hidden: heads*head_dim={spec.heads * spec.head_dim} must equal "
        f"hidden={spec.hidden}",
    )


def _check_deepseek(spec: MakeModelSpec) -> None:
    """Checks for the MLA sizes of DeepSeek-V3 and its sparse-attention successors."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        _require(getattr(spec, name) > 0, f"{name}={getattr(spec, name)} must be positive")
    _require(spec.q_lora_rank >= 0, f"q_lora_rank={spec.q_lora_rank} must be positive, or 0 for none")
    _require(
        spec.arch not in DSA_ARCHS or spec.q_lora_rank > 0,
        f"q_lora_rank=0: {spec.arch}'s sparse-attention indexer reads the query latent, so it needs one",
    )
    _require(
        spec.qk_rope_head_dim > 0 and spec.qk_rope_head_dim % 2 == 0,
        f"qk_rope_head_dim={spec.qk_rope_head_dim} must be positive and even",
    )


def _check_grouped_router(spec: MakeModelSpec) -> None:
    """Checks for the group-limited routing, shared experts and dense layers of DeepSeek-V3 and
    GLM-4.5 and of their sparse-attention successors."""
    # n_shared_experts too: HF always builds them, and with 0 saves empty tensors.
    for name in ("n_group", "topk_group", "n_shared_experts"):
        _require(getattr(spec, name) > 0, f"{name}={getattr(spec, name)} must be positive")
    _require(spec.experts % spec.n_group == 0, f"experts={spec.experts} is not divisible by n_group={spec.n_group}")
    per_group = spec.experts // spec.n_group
    # The router scores a group by the sum of its two best experts.
    _require(per_group >= 2, f"n_group={spec.n_group} leaves fewer than 2 experts per group")
    _require(spec.topk_group <= spec.n_group, f"topk_group={spec.topk_group} exceeds n_group={spec.n_group}")
    _require(
        spec.top_k <= spec.topk_group * per_group,
        f"top_k={spec.top_k} exceeds the {spec.topk_group * per_group} experts in topk_group={spec.topk_group} groups",
    )
    _require(
        0 <= spec.first_k_dense_replace < spec.layers,
        f"first_k_dense_replace={spec.first_k_dense_replace} leaves no MoE layer among layers={spec.layers}",
    )
