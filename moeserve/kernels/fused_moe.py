"""Fused MoE grouped GEMM: every routed expert's gated MLP in two Triton kernels.

The (token, k) pairs arrive sorted by expert and padded per expert to a multiple of BLOCK_M
(`AlignedPairs`, made by `moeserve.kernels.moe_align`), so every BLOCK_M rows of the sorted order
belong to one expert and a tile of rows is an ordinary GEMM against that expert's weights:

1. gate/up: `act[s] = silu(x w_gate^T) * (x w_up^T)` for sorted position s, x = hidden[pair // top_k].
   Rows are gathered from `hidden` on the fly (no permuted copy of the activations) and SiLU-and-
   multiply runs in the epilogue, so the `[P_max, 2I]` gate/up product never reaches memory. The
   activation `[P_max, I]` is indexed by sorted position: a plain store, no scatter.
2. down: `out[pair] = act[s] w2^T * pair_weights[pair]`: the combine weight is applied in the
   epilogue and each row is scattered to its pair's row of the output.

Two uses by the model:

* EP = 1: rows are tokens, `top_k = K`; the alignment is built from the router's `topk_ids [T, K]`
  and row p of the output is token p // K's k = p % K expert output, ready for a sum over k.
* After an expert-parallel dispatch: rows already arrive grouped by local expert. The caller aligns
  `topk_ids [N, 1]` = the local expert of each row and passes `top_k = 1`; row p of the output is
  row p's expert output, in the dispatch's order, for the combine to send back.

Both kernels use a persistent grid: at most `max_programs` programs, each looping over tiles
`tile = pid, pid + num_programs, ...`, so a caller can leave SMs free for communication kernels
running beside the GEMM. The number of live tiles comes from `num_padded` read on the device:
no host sync, so the launch is CUDA-graph capturable at a fixed `[T, K]` shape.

Tile sizes follow the tokens routed per expert (`KERNEL_CONFIGS`): decode is weight-bandwidth
bound (few rows per expert, BLOCK_M = 16 wastes little), prefill is tensor-core bound (64/128).
The alignment's block size must be the kernel's BLOCK_M: callers get it from `block_m_for` and
`fused_moe` recovers it from the alignment's shape.

FP8 weights (e4m3 with per-128x128-block scales) are a later step: the weight tile loads in the K
loops are the single place a scale pointer and a per-K-block rescale of the partial product would go.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if TYPE_CHECKING:
    from moeserve.kernels.moe_align import AlignedPairs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SM90_SHARED_MEMORY = 232448  # bytes a block may opt into on H100/H200; the budget under the interpreter
CPU_PROGRAMS = 4  # the interpreter runs programs one after another: a few still exercise the persistent loop


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters shared by both GEMMs of one `fused_moe` call.

    In the gate/up kernel a tile holds two `[block_m, block_n]` fp32 accumulators (gate and up
    columns n), so its shared-memory and register footprint is that of a 2 * block_n tile.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (largest mean tokens per expert, config), first match wins. block_m is unique per row: it is how
# `fused_moe` finds the config from an alignment. Starting points for bf16 on an H100, to retune with
# bench/moe_kernel.py; in bf16 every row fits sm_90's shared memory at its stage count, and
# `fit_num_stages` trims the stages where a wider dtype or a smaller GPU would not.
KERNEL_CONFIGS: tuple[tuple[float, KernelConfig], ...] = (
    (16, KernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)),
    (64, KernelConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=4)),
    (256, KernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)),
    (float("inf"), KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)),
)


def config_for(num_tokens: int, top_k: int, num_experts: int) -> KernelConfig:
    """The config for `num_tokens` rows routed `top_k` ways over `num_experts` (local) experts."""
    if num_tokens < 0 or top_k < 1 or num_experts < 1:
        raise ValueError(
            f"need num_tokens >= 0, top_k >= 1, num_experts >= 1; got {num_tokens}, {top_k}, {num_experts}"
        )
    tokens_per_expert = num_tokens * top_k / num_experts
    return next(cfg for limit, cfg in KERNEL_CONFIGS if tokens_per_expert <= limit)


def block_m_for(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The block size to align `topk_ids [num_tokens, top_k]` with before calling `fused_moe`."""
    return config_for(num_tokens, top_k, num_experts).block_m


def _config_for_block_m(block_m: int) -> KernelConfig:
    for _, cfg in KERNEL_CONFIGS:
        if cfg.block_m == block_m:
            return cfg
    known = [cfg.block_m for _, cfg in KERNEL_CONFIGS]
    raise ValueError(f"alignment block_m={block_m} has no kernel config (known: {known}); align with block_m_for(...)")


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _shared_memory_budget(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", SM90_SHARED_MEMORY)


def fit_num_stages(cfg: KernelConfig, elem_bytes: int, weight_tiles: int, budget: int) -> int:
    """The config's stage count, lowered until every stage's operand tiles fit `budget` bytes.

    A stage holds one `[block_m, block_k]` activation tile and `weight_tiles` `[block_k, block_n]`
    weight tiles (2 for gate/up, 1 for down). The table is sized for bf16: fp32 needs fewer stages.
    """
    stage_bytes = (cfg.block_m + weight_tiles * cfg.block_n) * cfg.block_k * elem_bytes
    return max(1, min(cfg.num_stages, budget // stage_bytes))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def default_max_programs(device: torch.device) -> int:
    """One program per SM on CUDA; a handful under the CPU interpreter."""
    if device.type == "cuda":
        return _sm_count(_device_index(device))
    return CPU_PROGRAMS


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block), GROUP_M row blocks at a time so tiles running
    together share weight columns in L2."""
    group_width = GROUP_M * num_pid_n
    first_m = (tile // group_width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_width) % group_rows
    pid_n = (tile % group_width) // group_rows
    return pid_m, pid_n


@triton.jit
def _gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    act_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """act[s, n] = silu(hidden[pair_s // top_k] . w_gate[n]) * (hidden[pair_s // top_k] . w_up[n])."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(inter_size, BLOCK_N)
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs  # padding rows hold the sentinel num_pairs
        token = (pair // top_k).to(tl.int64)
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_wn = offs_n % inter_size  # wrap instead of masking: the extra columns are never stored
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = hidden_ptr + token[:, None] * stride_hm + offs_k[None, :] * stride_hk
        gate_ptrs = w13_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
        up_ptrs = gate_ptrs + inter_size * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w_gate = tl.load(gate_ptrs)
                w_up = tl.load(up_ptrs)
            else:
                k_ok = offs_k + k0 < hidden_size
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w_gate = tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0)
                w_up = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
            acc_gate += tl.dot(a, w_gate, input_precision=PRECISION)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_hk
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        act_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=offs_n[None, :] < inter_size)


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[pair_s, n] = (act[s] . w2[n]) * pair_weights[pair_s], for real (non-padding) pairs."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(hidden_size, BLOCK_N)
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        row_ok = pair < num_pairs
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_wn = offs_n % hidden_size
        offs_k = tl.arange(0, BLOCK_K)
        # Every row of a live block was written by the gate/up kernel (padding rows as zeros).
        a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w2_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_k + k0 < inter_size
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            acc += tl.dot(a, w, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if HAS_WEIGHTS:
            acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < hidden_size))


def _validate(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None,
    max_programs: int | None,
) -> int:
    """Checks shapes, dtypes and devices; returns the alignment's block_m."""
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"need hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}"
        )
    num_experts, two_inter, hidden_size = w13.shape
    if hidden.shape[1] != hidden_size or two_inter % 2 or tuple(w2.shape) != (num_experts, hidden_size, two_inter // 2):
        raise ValueError(
            f"inconsistent shapes: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if hidden.dtype not in SUPPORTED_DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(
            f"hidden, w13, w2 must share one of {SUPPORTED_DTYPES}; got {hidden.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    ids, experts, num_padded = aligned.sorted_pair_ids, aligned.block_experts, aligned.num_padded
    tensors = {"w13": w13, "w2": w2, "sorted_pair_ids": ids, "block_experts": experts, "num_padded": num_padded}
    if pair_weights is not None:
        tensors["pair_weights"] = pair_weights
    for name, t in tensors.items():
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}")
    for name, t in (("sorted_pair_ids", ids), ("block_experts", experts), ("num_padded", num_padded)):
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"aligned.{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if num_padded.numel() != 1 or experts.numel() == 0 or ids.numel() % experts.numel():
        raise ValueError(
            f"bad alignment: {ids.numel()} sorted ids, {experts.numel()} blocks, num_padded of {num_padded.numel()} "
            "elements"
        )
    block_m = ids.numel() // experts.numel()
    num_pairs = hidden.shape[0] * top_k
    expected = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    if ids.numel() != expected:
        raise ValueError(
            f"alignment has {ids.numel()} slots, expected {expected} for {hidden.shape[0]} rows x top_k={top_k} over "
            f"{num_experts} experts at block_m={block_m}: was it built for another batch or expert count?"
        )
    if pair_weights is not None and (pair_weights.dtype != torch.float32 or pair_weights.shape != (num_pairs,)):
        raise ValueError(
            f"pair_weights must be float32 [{num_pairs}], got {pair_weights.dtype} {tuple(pair_weights.shape)}"
        )
    return block_m


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """Expert outputs of every (row, k) pair: `[T_rows * top_k, H]` in hidden's dtype.

    hidden `[T_rows, H]`; w13 `[E, 2I, H]` (gate rows then up rows); w2 `[E, H, I]`; `aligned` =
    `moe_align_block_size(topk_ids [T_rows, top_k], E, block_m_for(T_rows, top_k, E))`. Row p is
    expert(p's expert)(hidden[p // top_k]) times `pair_weights[p]` (float32 `[T_rows * top_k]`) if
    given; rows of pairs the alignment skipped (expert ids outside [0, E)) are zero. With EP = 1 the
    token's output is `out.view(T, K, H).sum(1)`; after an EP dispatch (top_k = 1) row p is
    dispatched row p's output. Accumulates in fp32 (exact fp32 dots for fp32 inputs, no tf32); the
    activation between the GEMMs is rounded to hidden's dtype. `max_programs` caps each kernel's
    persistent grid (default: one program per SM) so the other SMs stay free.
    """
    block_m = _validate(hidden, w13, w2, aligned, top_k, pair_weights, max_programs)
    if hidden.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"fused_moe runs on CUDA, or elsewhere only under TRITON_INTERPRET=1; hidden is on {hidden.device}"
        )
    cfg = _config_for_block_m(block_m)
    num_experts, two_inter, hidden_size = w13.shape
    inter_size = two_inter // 2
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    num_slots = aligned.sorted_pair_ids.numel()
    act = torch.empty(num_slots, inter_size, dtype=hidden.dtype, device=hidden.device)
    programs = max_programs if max_programs is not None else default_max_programs(hidden.device)
    num_blocks = num_slots // block_m
    # fp32 stays exact (no tf32), like torch's default matmul: it is a checking dtype, not a serving one.
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    launch = dict(
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        PRECISION=precision,
        num_warps=cfg.num_warps,
    )
    budget = _shared_memory_budget(_device_index(hidden.device)) if hidden.device.type == "cuda" else SM90_SHARED_MEMORY

    # Grids are capped by the tile count of a fully padded alignment, a host-side bound.
    grid = (min(programs, num_blocks * triton.cdiv(inter_size, cfg.block_n)),)
    _gate_up_kernel[grid](
        hidden,
        w13,
        act,
        aligned.sorted_pair_ids,
        aligned.block_experts,
        aligned.num_padded,
        num_pairs,
        top_k,
        hidden_size,
        inter_size,
        hidden.stride(0),
        hidden.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        act.stride(0),
        act.stride(1),
        EVEN_K=hidden_size % cfg.block_k == 0,
        num_stages=fit_num_stages(cfg, hidden.element_size(), 2, budget),
        **launch,
    )
    grid = (min(programs, num_blocks * triton.cdiv(hidden_size, cfg.block_n)),)
    _down_kernel[grid](
        act,
        w2,
        out,
        pair_weights if pair_weights is not None else out,
        aligned.sorted_pair_ids,
        aligned.block_experts,
        aligned.num_padded,
        num_pairs,
        hidden_size,
        inter_size,
        act.stride(0),
        act.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        out.stride(0),
        out.stride(1),
        EVEN_K=inter_size % cfg.block_k == 0,
        HAS_WEIGHTS=pair_weights is not None,
        num_stages=fit_num_stages(cfg, hidden.element_size(), 1, budget),
        **launch,
    )
    return out


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """Torch version of `fused_moe`, one expert at a time, what the kernels are tested against.

    Computes in fp32 and rounds the activation to hidden's dtype as the kernel stores it.
    `max_programs` only exists for signature parity: there is no grid here.
    """
    _validate(hidden, w13, w2, aligned, top_k, pair_weights, max_programs)
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(num_pairs, w13.shape[2], dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    block_m = aligned.sorted_pair_ids.numel() // aligned.block_experts.numel()
    ids = aligned.sorted_pair_ids.long()
    slot_expert = aligned.block_experts.long().repeat_interleave(block_m)
    live = ids < num_pairs
    for expert in torch.unique(slot_expert[live]).tolist():
        pairs = ids[live & (slot_expert == expert)]
        x = hidden[pairs // top_k].float()
        gate, up = F.linear(x, w13[expert].float()).chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(hidden.dtype).float()
        y = F.linear(act, w2[expert].float())
        if pair_weights is not None:
            y = y * pair_weights[pairs, None]
        out[pairs] = y.to(hidden.dtype)
    return out
