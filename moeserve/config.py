"""Configuration dataclasses shared by every subsystem.

`ModelConfig` is the one normalised view of a checkpoint's `config.json`: each architecture
module translates its Hugging Face field names into these fields (see
`moeserve/models/architectures/`), so the layers never read raw HF keys and every missing or
malformed key is reported in one place, before any weight is read.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Literal

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """Accept 'float32'/'fp32'/'bf16'/... or a torch dtype; 'auto' -> None (the checkpoint's
    own dtype, as vLLM does); reject anything else by name."""
    if name == "auto":
        return None
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"unsupported dtype {name}; choose one of {sorted(DTYPES)}")
        return name
    aliases = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[key]


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass: field docs that double as CLI help."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


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
class RouterConfig:
    """How router logits become top-k expert ids and weights.

    `softmax`: softmax over all experts, top-k, optionally renormalised (Mixtral always
    renormalises; Qwen only with norm_topk_prob); with groups (DeepSeek-V2's
    group_limited_greedy) only experts of the `topk_groups` groups holding the best experts.
    `grouped_sigmoid`: DeepSeek-V3 — sigmoid scores, a per-expert correction bias used only for
    choosing, group-limited selection, optional renormalisation, then a global scale.
    """

    kind: Literal["softmax", "grouped_sigmoid"]
    top_k: int
    renormalize: bool
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False
    logits_in_fp32: bool = False  # DeepSeek computes the gate GEMM in float32


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k
    mla: MLAConfig | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        if not 1 <= self.router.top_k <= max(self.num_experts, 1):
            raise ValueError(f"num_experts_per_tok {self.router.top_k} must be in [1, {self.num_experts}]")
        if len(self.moe_layers) != self.num_layers or len(self.sliding_windows) != self.num_layers:
            raise ValueError("per-layer settings must have num_hidden_layers entries")
        if self.router.kind == "grouped_sigmoid" and self.num_experts % self.router.num_groups:
            raise ValueError(f"n_routed_experts {self.num_experts} is not divisible by n_group {self.router.num_groups}")

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        """Decoder layers that hold an MoE block, in order."""
        return tuple(i for i, moe in enumerate(self.moe_layers) if moe)


@dataclass(frozen=True)
class ParallelConfig:
    """Process layout: `ep` ranks hold the experts (E/ep each); attention runs data-parallel
    over `ep / tp` groups of `tp` tensor-parallel ranks. ep = tp = 1 runs in one process."""

    ep: int = 1
    tp: int = 1
    nnodes: int = 1
    """Machines the ranks span; each runs `ep / nnodes` of them."""
    node_rank: int = 0
    """This machine's index; node 0 runs the scheduler and the API."""
    master_addr: str = "127.0.0.1"
    """Where node 0 listens for the others to rendezvous (its TCP store)."""
    master_port: int = 0
    """Port of that store; 0 picks a free one, which only a single node can use."""
    backend: str = "auto"
    """Collectives between ranks: gloo, nccl, or auto (nccl on CUDA devices, gloo on CPU)."""
    collective_timeout_s: float = 120.0
    """Longest any collective may wait before the rank gives up (a stalled peer)."""
    heartbeat_timeout_s: float = 5.0
    """A rank silent for this long is declared lost and the engine stops."""
    startup_timeout_s: float = 600.0
    """How long node 0 waits for every rank to join and load its weights."""

    def __post_init__(self) -> None:
        if self.ep < 1 or self.tp < 1:
            raise ValueError(f"ep and tp must be >= 1 (got ep={self.ep}, tp={self.tp})")
        if self.ep % self.tp:
            raise ValueError(f"ep={self.ep} must be a multiple of tp={self.tp}")
        if self.nnodes < 1 or self.ep % self.nnodes:
            raise ValueError(f"ep={self.ep} ranks cannot be spread evenly over nnodes={self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} outside [0, {self.nnodes})")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a multi-node launch needs a fixed --master-port that every node uses")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend {self.backend!r} is not one of auto, gloo, nccl")
        if min(self.collective_timeout_s, self.heartbeat_timeout_s, self.startup_timeout_s) <= 0:
            raise ValueError("timeouts must be > 0")

    @property
    def is_distributed(self) -> bool:
        return self.ep > 1 or self.tp > 1

    @property
    def num_dp_groups(self) -> int:
        return self.ep // self.tp

    @property
    def ranks_per_node(self) -> int:
        return self.ep // self.nnodes


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16  # tokens per block: small enough to waste little, large enough to gather fast
    num_blocks: int | None = None  # None: derived from memory_bytes
    memory_bytes: int = 512 * 1024**2  # KV budget when num_blocks is not given (CPU default)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")


@dataclass(frozen=True)
class SLOConfig:
    """Latency targets: what the `slo` scheduling policy aims for and what /metrics judges
    every finished request against (attainment counters), whichever policy runs."""

    ttft_s: float = 5.0
    """Time to first token target, from arrival to the first generated token."""
    tbt_s: float = 0.025
    """Time between tokens target: every gap between consecutive tokens of a stream."""

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tbt_s > 0):
            raise ValueError(f"SLO targets must be > 0 (got ttft_s={self.ttft_s}, tbt_s={self.tbt_s})")


SCHEDULING_POLICIES = ("fcfs", "slo")
KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the checkpoint's own config."""

    model: str
    dtype: torch.dtype | None = None  # None ("auto"): the checkpoint's own dtype
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0
    scheduling_policy: str = "fcfs"  # "fcfs", or "slo": TBT-sized prefill chunks, TTFT-deadline order
    slo: SLOConfig = field(default_factory=SLOConfig)
    max_waiting: int | None = None  # most queued requests; beyond it add_request raises QueueFullError
    kernels: str = "auto"
    """Layer operations backend: torch, triton, or auto (see `ops.create_ops`)."""
    min_step_time_s: float = 0.0
    """Test-only: pad every non-empty step to at least this long, so load tests can build a
    server with a known capacity (the SLO harness checks its knee search against it)."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {self.scheduling_policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}")
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"kernels {self.kernels!r} is not one of {', '.join(KERNEL_BACKENDS)}")
