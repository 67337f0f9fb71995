"""The numerical operations layers delegate to, with one backend per kind of device.

Layers own parameters and the order of operations; how a norm, a rotation, a linear, attention
over the paged cache, routing or the experts' grouped GEMM is computed is a backend's business:
`TorchOps` (the reference, and the CPU path) or `TritonOps` (the GPU path, also runnable on CPU
through Triton's interpreter for tests). Every backend must give the reference's results within
its dtype's tolerance (with FP8 weights, within what quantizing the activations changes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from moeserve.config import GatedActivation, MLAConfig, ModelConfig, RouterConfig
from moeserve.dispatch.base import DispatchLayout
from moeserve.dispatch.fp8 import FP8Rows
from moeserve.fp8_format import BlockFP8Weight
from moeserve.ops.attention import AttentionBatch, AttentionPlan, DecodeGraphInputs
from moeserve.ops.compressed_attention import PagedRows, SequenceKeys
from moeserve.ops.state_batch import StateStep
from moeserve.packed_weight import PackedExperts

PlanT = TypeVar("PlanT", bound=AttentionPlan)

Weight = torch.Tensor | BlockFP8Weight | PackedExperts
"""A GEMM weight as a layer stores it: a tensor in the model's dtype, block-quantized FP8 bytes
with their scales, or packed 4-bit experts with theirs (`models.fp8.stored_weight`), which each
backend multiplies its own way."""


def dense_weight(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """`weight`'s values as a tensor: FP8 or packed experts dequantized into `dtype`, anything
    else as it is."""
    return weight.dequantize(dtype) if isinstance(weight, BlockFP8Weight | PackedExperts) else weight


class LayerOps(ABC, Generic[PlanT]):
    """`PlanT`: the backend's own attention plan, made by its `plan_attention` once per step and
    handed back to its attention methods by every layer."""

    name: str

    @classmethod
    def supports(cls, device: torch.device) -> str | None:
        """None if this backend can run on `device`, else the reason it cannot."""
        return None

    @classmethod
    def supports_model(cls, cfg: ModelConfig) -> str | None:
        """None if this backend computes every layer option `cfg` asks for, else the first it
        lacks (the loader turns a reason into a clear error, never a fallback)."""
        return None

    @abstractmethod
    def plan_attention(self, batch: AttentionBatch) -> PlanT:
        """Once per step, before any layer: what this backend's attention needs about the step."""

    @abstractmethod
    def decode_graph_planner(self, inputs: DecodeGraphInputs) -> Callable[[], PlanT]:
        """The plan of a captured decode step over `inputs`' persistent buffers, in two halves: what
        needs the host (constants, launch sizes) is done here, once, before capture; the returned
        callable runs inside the captured step on every replay and may only launch device work
        (no host reads, no uploads), since a CUDA graph replays its kernels and nothing else.
        Its plan must give each sequence the bits `plan_attention` gives it in an eager step."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim: normalise in fp32, cast back, then scale (HF's order)."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h = x + residual` in their dtype, then `(rms_norm(h), h)`: the residual add that closes
        a sub-layer and the norm that opens the next, in one pass where the backend can fuse them.
        Neither input is modified."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x `[..., in]` times weight `[out, in]` transposed, plus bias `[out]` -> `[..., out]` in x's
        dtype. An FP8 weight: the torch path dequantizes it and matches the dequantized model; a
        w8a8 path also quantizes x (per token group) and is as close as that rounding allows."""

    @abstractmethod
    def rotary_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, R]`, k `[T, Hk, R]` rotated by cos/sin `[T, R]` (see `ops.rotary.apply_rotary`
        for the layouts) -> (q, k). A backend may rotate in place and return q and k themselves, so
        callers pass tensors they own (strided views into them are fine) and use what is returned."""

    @abstractmethod
    def gated_delta_net(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weight: torch.Tensor,
        step: StateStep,
        head_dims: tuple[int, int],
    ) -> torch.Tensor:
        """Gated DeltaNet's core for the step's packed sequences: `mixed [T, 2 * Hk * Dk + Hv * Dv]`
        (q, k, v before the conv), log decays `g` (float32) and `beta`, `[T, Hv]`, the conv's
        `[C, K]` weight, `head_dims` (Dk, Dv) -> `[T, Hv, Dv]` in mixed's dtype. Reads and rewrites
        each sequence's conv and recurrent state in its slot (`step`)."""

    @abstractmethod
    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PlanT,
        scale: float,
        sliding_window: int | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q `[T, Hq, D]` over the step's paged context -> `[T, Hq, Dv]`.

        sinks: `[Hq]` (gpt-oss) or None: a logit per head that joins each query's softmax as one
        more key without a value, taking its share of the probability mass."""

    @abstractmethod
    def mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: PlanT,
        kv_b_weight: torch.Tensor,
        mla: MLAConfig,
        scale: float,
    ) -> torch.Tensor:
        """MLA: queries `[T, H, nope]` and rotated `[T, H, rope]` over the latent cache, with
        kv_b_proj's weight `[H * (nope + v), kv_lora_rank]` -> `[T, H, v]`."""

    @abstractmethod
    def dsa_select(
        self, q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, plan: PlanT, index_topk: int
    ) -> Any:
        """DeepSeek Sparse Attention's indexer: rotated queries `[T, Hi, Di]`, head weights `[T, Hi]`
        float32 and the key cache holding this step's keys -> each query's top `index_topk`
        positions, in the backend's own form, which only its `sparse_mla_attention` reads (the
        layer keeps it in `plan.selections` for the layers that reuse it). Contexts no longer
        than `index_topk` may be marked dense instead."""

    @abstractmethod
    def sparse_mla_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: PlanT,
        kv_b_weight: torch.Tensor,
        mla: MLAConfig,
        scale: float,
        selection: Any,
    ) -> torch.Tensor:
        """`mla_attention` where each query sees only the positions `selection` chose."""

    @abstractmethod
    def compressed_select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: PagedRows, start: int, ratio: int, top_k: int
    ) -> Any:
        """DeepSeek-V4's lightning indexer for one sequence's queries at positions `start ..`:
        rotated queries `[S, Hi, Di]`, head weights `[S, Hi]` float32 (scaled by Hi ** -0.5) and
        the sequence's indexer entries (one per `ratio` positions, this step's written) -> each
        query's `top_k` best visible entries in the backend's own form, which only its
        `compressed_attention` reads (`ops.compressed_attention.top_entries` defines them)."""

    @abstractmethod
    def compressed_attention(
        self, q: torch.Tensor, sinks: torch.Tensor, scale: float, keys: SequenceKeys, selection: Any
    ) -> torch.Tensor:
        """DeepSeek-V4's shared-KV attention of one sequence's queries `[S, Hq, D]` over its
        window's last keys and, on a compressed layer, its entries closed at each query: all of
        them (`selection` None, HCA) or those `compressed_select` chose (CSA); `sinks [Hq]` join
        each softmax -> `[S, Hq, D]` (`ops.compressed_attention.compressed_attention` defines it)."""

    @abstractmethod
    def route(
        self, cfg: RouterConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits `[T, E]` (fp32 for sigmoid routers) -> (topk_ids int64, topk_weights fp32;
        gpt-oss's `topk_softmax`: in the logits' dtype, as its reference)."""

    @abstractmethod
    def experts(
        self,
        x: torch.Tensor,
        layout: DispatchLayout,
        counts: torch.Tensor,
        topk_ids: torch.Tensor | None,
        w13: Weight,
        w2: Weight,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        activation: GatedActivation | None = None,
        x_fp8: FP8Rows | None = None,
    ) -> torch.Tensor:
        """A DispatchOutput's rows through their experts' gated MLPs, without a host sync.

        x `[N, H]`, counts int64 `[E_local]` and topk_ids (TOKEN_MAJOR: int64 `[T, K]` local ids)
        as the DispatchOutput gives them; w13 `[E_local, 2I, H]`, w2 `[E_local, H, I]` (both FP8 or
        neither, as `linear`'s weight); biases
        b13 `[E_local, 2I]` and b2 `[E_local, H]` or None (gpt-oss has them); `activation`
        turns gate and up into the down projection's input (None: silu(gate) * up). `x_fp8`: the
        same rows as the FP8 dispatch carried them (`DispatchOutput.fp8_rows`), or None; a backend
        whose FP8 experts quantize their input the same way may use them instead of x.
        Returns TOKEN_MAJOR: `[T * K, H]`, row `t * K + k` = expert `topk_ids[t, k]` on token t;
        EXPERT_MAJOR: `[N, H]`, row by row (padding rows past `sum(counts)` unspecified).
        """
