"""Configuration dataclasses shared by every subsystem.

`ModelConfig` is the one normalised view of a checkpoint's `config.json`: each architecture
module translates its Hugging Face field names into these fields (see
`moeserve/models/architectures/`), so the layers never read raw HF keys and every missing or
malformed key is reported in one place, before any weight is read.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Literal

import torch

# The engine's user-facing configs live torch-free in `engine_config`; importable from here as before.
from moeserve.engine_config import CacheConfig, EngineConfig, ParallelConfig, SLOConfig, dtype_name

__all__ = [
    "DTYPES",
    "CacheConfig",
    "CompressedAttentionConfig",
    "EngineConfig",
    "GatedActivation",
    "HyperConnectionConfig",
    "LinearAttentionConfig",
    "MLAConfig",
    "ModelConfig",
    "NVFP4Config",
    "PackedInt4Config",
    "ParallelConfig",
    "RopeConfig",
    "RouterConfig",
    "SLOConfig",
    "WeightQuant",
    "parse_dtype",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """Accept 'float32'/'fp32'/'bf16'/... or a torch dtype; 'auto' -> None (the checkpoint's
    own dtype, as vLLM does); reject anything else by name."""
    key = dtype_name(name)
    return None if key == "auto" else DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding, normalised from HF `rope_parameters` / `rope_scaling`."""

    theta: float
    rotary_dim: int  # dimensions that rotate (DeepSeek MLA: qk_rope_head_dim only)
    kind: Literal["default", "linear", "yarn"] = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False  # DeepSeek's rope_interleave: pairs (x0,x1),(x2,x3) instead of halves


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention dimensions."""

    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer of `index_n_heads`
    heads of `index_head_dim` scores every cached token for each query, and MLA attends only to
    the `index_topk` best. The indexer rotates the first `qk_rope_head_dim` dims of its heads:
    split in halves (DeepSeek-V3.2) or in interleaved pairs (GLM-5, `interleaved_rope`).

    `indexer_layers`: per decoder layer, whether it runs its own indexer (and caches its keys) or
    reuses the top-k of the last layer before it that does (GLM-5's `index_topk_freq`).

    `fp8_keys`: cache the indexer's keys as DeepSeek-V3.2's release does, e4m3 with one float32
    scale per token (`index_head_dim + 4` bytes), instead of in the compute dtype as transformers
    keeps them; an engine option (`EngineConfig.indexer_key_dtype`), not read from the checkpoint."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    interleaved_rope: bool
    indexer_layers: tuple[bool, ...]
    fp8_keys: bool = False

    def __post_init__(self) -> None:
        if not self.indexer_layers or not self.indexer_layers[0]:
            raise ValueError("the first layer of a DSA model must run its own indexer")

    def has_indexer(self, layer: int) -> bool:
        """Whether `layer` runs an indexer; an MTP layer (past the decoder's) always does."""
        return layer >= len(self.indexer_layers) or self.indexer_layers[layer]

    def source_layer(self, layer: int) -> int:
        """The layer whose top-k `layer` attends with: itself, or the last indexer layer before it."""
        if self.has_indexer(layer):
            return layer
        return max(i for i in range(layer) if self.indexer_layers[i])


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): Hk key heads of Dk, Hv value heads of Dv (each
    key head serves Hv / Hk consecutive value heads), a depthwise causal conv of `conv_kernel` taps.

    `grouped_projections`: Qwen3-Next stores q, k, v, z in one `in_proj_qkvz` and b, a in one
    `in_proj_ba`, rows grouped by key head; Qwen3.5 stores `in_proj_qkv` (all q, then k, then v),
    `in_proj_z`, `in_proj_b` and `in_proj_a`."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    grouped_projections: bool

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class CompressedAttentionConfig:
    """DeepSeek-V4's attention: shared-KV MQA (one `head_dim` head read as key and value) over a
    sliding window of `window` tokens, plus, by layer, entries compressed from every
    `compress_ratios[i]` tokens (0: the window only; 4: CSA, whose entries a lightning indexer
    narrows to `index_topk` per query; 128 or any other ratio: HCA, attended densely). q from a
    low-rank `q_lora_rank` projection; the output projected per group of heads (`o_groups`, each to
    `o_lora_rank`) then mixed. Window-only layers rotate with the model's `RopeConfig`, the
    compressed ones (their queries, window keys and entries alike) with `compress_rope`."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    sparse_ratio: int  # the ratio whose layers run the indexer (CSA)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope: RopeConfig

    def ratio(self, layer: int) -> int:
        """Layer `layer`'s tokens per compressed entry; 0 past the decoder's layers: an MTP
        block attends its window only (the release's `compress_ratios` ends with its 0)."""
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0


@dataclass(frozen=True)
class HyperConnectionConfig:
    """DeepSeek-V4's manifold-constrained hyper-connections: the residual is `mult` streams, mixed
    around each block by a matrix Sinkhorn-normalised over `sinkhorn_iters` iterations (`eps`: the
    floor of every normalisation)."""

    mult: int
    sinkhorn_iters: int
    eps: float


@dataclass(frozen=True)
class RouterConfig:
    """How router logits become top-k expert ids and weights.

    `softmax`: softmax over all experts, top-k, optionally renormalised (Mixtral always
    renormalises; Qwen only with norm_topk_prob); with groups (DeepSeek-V2's
    group_limited_greedy) only experts of the `topk_groups` groups holding the best experts.
    `grouped_sigmoid`: DeepSeek-V3 — sigmoid scores, a per-expert correction bias used only for
    choosing, group-limited selection, optional renormalisation, then a global scale (GLM-4.5
    alike; MiniMax-M2 with one group).
    `topk_softmax`: gpt-oss — top-k of the raw logits, then softmax over the k picked logits.
    `sqrtsoftplus`: DeepSeek-V4 — scores sqrt(softplus(logit)), chosen with the correction bias,
    always renormalised, then scaled.
    """

    kind: Literal["softmax", "grouped_sigmoid", "topk_softmax", "sqrtsoftplus"]
    top_k: int
    renormalize: bool
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False
    logits_in_fp32: bool = False  # DeepSeek computes the gate GEMM in float32
    has_bias: bool = False  # gpt-oss: the gate linear has a bias


@dataclass(frozen=True)
class GatedActivation:
    """How an expert turns its gate and up projections into the down projection's input.

    `silu`: silu(gate) * up (every architecture but gpt-oss).
    `clamped_swiglu`: gpt-oss — gate clamped above at `limit`, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate).
    `clamped_silu`: DeepSeek-V4 — the same clamps, then the plain silu(gate) * up.
    """

    kind: Literal["silu", "clamped_swiglu", "clamped_silu"] = "silu"
    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class BlockFP8Config:
    """FP8 block-quantized weights as DeepSeek-V3 and Qwen3-FP8 publish them: a quantized linear
    weight `[out, in]` is float8_e4m3fn with `weight_scale_inv [ceil(out/bo), ceil(in/bi)]` (stored
    float32, bfloat16 or float16, held float32); its value is `weight.float() * scale_inv` over each
    `block = (bo, bi)` tile. Activations
    are quantized dynamically by kernels that have a w8a8 GEMM (the torch path dequantizes).
    `not_converted`: the release's `modules_to_not_convert` (Qwen3-Next's and Qwen3.5's list the
    modules they keep unquantized), names matched as transformers matches them; a tensor of one
    stored FP8 contradicts the config and is refused.

    DeepSeek-V4's releases add two settings: `scale_fmt: ue8m0` (every scale a power of two,
    stored as float32 or as e8m0 exponent bytes; `ue8m0`), and `expert_dtype: fp4` (the routed
    experts as e2m1 codes with an e8m0 scale per 32 inputs, the MXFP4 layout; `fp4_experts`)."""

    block: tuple[int, int] = (128, 128)
    not_converted: tuple[str, ...] = ()
    ue8m0: bool = False
    fp4_experts: bool = False

    def converts(self, module: str) -> bool:
        """Whether `module` (a checkpoint name without `.weight`) may be stored FP8: not listed,
        neither as it, a module above it, nor a suffix of it."""
        return not any(
            module == name or module.startswith(name + ".") or module.endswith("." + name)
            for name in self.not_converted
        )


@dataclass(frozen=True)
class MXFP4Config:
    """gpt-oss's MXFP4 experts as OpenAI publishes them: each routed expert projection is e2m1
    FP4 codes, two per byte, with one e8m0 power-of-two scale per 32 input values
    (`mxfp4_format.py`); everything else is unquantized. The format has no setting to carry:
    blocks of 32 and the scale bias are fixed. Activations stay in the compute dtype."""


@dataclass(frozen=True)
class PackedInt4Config:
    """compressed-tensors `pack-quantized` W4A16 weights (Kimi-K2-Thinking, Kimi-K2.5): signed
    4-bit integers, eight per int32, with one scale per `group_size` inputs (`int4_format.py`).
    Which modules are quantized is the config's `config_groups` targets less its `ignore` list,
    matched as the library matches them: a plain entry is a module name (or, for targets, the
    class `Linear`), a `re:` entry a regular expression matched at the name's start."""

    group_size: int
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (its checkpoint name) is stored quantized."""
        return not any(_matches(module, i) for i in self.ignore) and any(
            t == "Linear" or _matches(module, t) for t in self.targets
        )


@dataclass(frozen=True)
class NVFP4Config:
    """ModelOpt NVFP4 weights (`quant_algo: NVFP4`): e2m1 codes, an FP8 scale per 16 inputs and a
    float32 scale per tensor (`nvfp4_format.py`). Every linear layer is quantized but those its
    `exclude_modules` (`ignore` in config.json) name, as shell-style wildcards (`fnmatch`), the
    way ModelOpt writes them (`model.layers.*.self_attn*`)."""

    exclude: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (its checkpoint name) is stored quantized."""
        return not any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude)


def _matches(module: str, entry: str) -> bool:
    """compressed-tensors' name match: `re:<pattern>` is re.match, anything else the exact name."""
    return re.match(entry[3:], module) is not None if entry.startswith("re:") else module == entry


WeightQuant = BlockFP8Config | MXFP4Config | PackedInt4Config | NVFP4Config


@dataclass(frozen=True)
class ModelConfig:
    """A checkpoint's architecture, in moeserve's own terms."""

    architecture: str  # the HF class name from config.json `architectures`
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int
    num_experts: int
    router: RouterConfig
    rope: RopeConfig
    rms_norm_eps: float
    max_position_embeddings: int
    moe_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP (False)
    sliding_windows: tuple[int | None, ...]  # per layer attention window, None = full
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(linear(x)) scales the shared expert
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["none", "head", "full"] = "none"
    """RMSNorm of q and k before rotary: over each head (Qwen3, GLM-4.5) or over the whole
    projection, all heads together (OLMoE, MiniMax-M2)."""
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip] after the norm
    attention_sinks: bool = False  # gpt-oss: a learnt per-head logit joins every softmax
    expert_activation: GatedActivation = GatedActivation()
    expert_bias: bool = False  # gpt-oss: the experts' gate/up and down projections have biases
    mla: MLAConfig | None = None
    dsa: DSAConfig | None = None  # DeepSeek-V3.2, GLM-5: MLA over the indexer's top-k tokens
    attention_scale: float | None = None  # None: head_dim ** -0.5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: torch.dtype = torch.float32
    weight_quant: WeightQuant | None = None  # None: weights stored in checkpoint_dtype
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: tuple[bool, ...] = ()
    """Per layer: a Gated DeltaNet (True) or attention (False); empty: attention everywhere."""
    attention_output_gate: bool = False
    """Qwen3-Next, Qwen3.5: q_proj gives each head's query and a gate; the attention output is
    scaled by sigmoid(gate) before o_proj."""
    zero_centered_norms: bool = False
    """Qwen3-Next, Qwen3.5: every RMSNorm (not the DeltaNet's gated one) scales by `1 + weight`; the
    loader stores `1 + weight`, so the layers are the usual ones."""
    compressed_attention: CompressedAttentionConfig | None = None
    """DeepSeek-V4: every layer's attention is `CompressedAttention` (None: attention or MLA)."""
    hyper_connections: HyperConnectionConfig | None = None
    """DeepSeek-V4: the residual stream is several streams mixed by hyper-connections."""
    hash_moe_layers: tuple[bool, ...] = ()
    """Per layer: its MoE routes by the token id (DeepSeek-V4's `hash_moe`, a `tid2eid` table);
    empty: every MoE layer routes by its router's scores."""
    shared_expert_activation: bool = False
    """DeepSeek-V4: the shared expert applies `expert_activation` too (its clamps); else plain silu."""
    num_mtp_layers: int = 0
    """Multi-token prediction layers the checkpoint stores after its decoder layers (DeepSeek-V3's
    and GLM-4.5's `num_nextn_predict_layers`); loaded only to draft (`spec_decode` method mtp)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if not 1 <= self.router.top_k <= max(self.num_experts, 1):
            raise ValueError(f"num_experts_per_tok {self.router.top_k} must be in [1, {self.num_experts}]")
        if self.linear_layers and (self.linear_attention is None or len(self.linear_layers) != self.num_layers):
            raise ValueError("linear_layers needs linear_attention and num_hidden_layers entries")
        if len(self.moe_layers) != self.num_layers or len(self.sliding_windows) != self.num_layers:
            raise ValueError("per-layer settings must have num_hidden_layers entries")
        if not 0 < self.rope.rotary_dim <= self.head_dim or self.rope.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rope.rotary_dim} must be even and in (0, head_dim {self.head_dim}]")
        if self.router.kind == "grouped_sigmoid" and self.num_experts % self.router.num_groups:
            raise ValueError(
                f"n_routed_experts {self.num_experts} is not divisible by n_group {self.router.num_groups}"
            )

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    def with_indexer_key_dtype(self, key_dtype: str) -> ModelConfig:
        """This config with `EngineConfig.indexer_key_dtype` applied: "auto" keeps the indexer's keys
        in the compute dtype, "fp8" caches them as e4m3 with a float32 scale per token
        (`DSAConfig.fp8_keys`), which only a DSA model has keys for."""
        if key_dtype == "auto":
            return self
        if self.dsa is None:
            raise ValueError(
                f"--indexer-key-dtype {key_dtype}: {self.architecture} has no lightning indexer "
                "(only DeepSeek Sparse Attention models, DeepSeek-V3.2 and GLM-5, cache indexer keys)"
            )
        return replace(self, dsa=replace(self.dsa, fp8_keys=key_dtype == "fp8"))

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a Gated DeltaNet (MTP layers, past the decoder's, never are)."""
        return layer < len(self.linear_layers) and self.linear_layers[layer]

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Decoder layers that hold an MoE block, in order."""
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)
