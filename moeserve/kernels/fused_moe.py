"""Fused MoE grouped GEMM: every routed expert's gated MLP in two Triton kernels.

The (token, k) pairs arrive sorted by expert and padded per expert to a multiple of BLOCK_M
(`AlignedPairs`, made by `moeserve.kernels.moe_align`), so every BLOCK_M rows of the sorted order
belong to one expert and a tile of rows is an ordinary GEMM against that expert's weights:

1. gate/up: `act[s] = silu(x w_gate^T) * (x w_up^T)` for sorted position s, x = hidden[pair // top_k]
   (or a clamped kind, `kernels.activation`: DeepSeek-V4's, gpt-oss's). Rows are gathered from
   `hidden` on the fly (no permuted copy of the activations) and the activation runs in the
   epilogue, so the `[P_max, 2I]` gate/up product never reaches memory. The activation
   `[P_max, I]` is indexed by sorted position: a plain store, no scatter.
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

Block-scaled FP8 (w8a8, `fused_moe_fp8.py`) runs the same two kernels with `W8A8` set: the rows
and the weights arrive as float8_e4m3fn with scales (`W8A8Scales`), and each K tile's fp32 partial
product is multiplied by its rows' activation scales and its columns' weight scales before it is
added to the accumulator (DeepSeek-V3's scheme: a K tile never straddles a scale block), in
tiles of half the bf16 tiles' columns from 64 rows on (`launch_config.w8a8_config`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.config import GatedActivation
from moeserve.gated_activation import gated
from moeserve.kernels.activation import activation_constants, gated_activation
from moeserve.kernels.fp8_quant import per_token_group_quant
from moeserve.kernels.gemm_tiles import tile_coords, weight_scale_offsets
from moeserve.kernels.launch_config import (
    SM90_SHARED_MEMORY,
    config_for_block_m,
    default_max_programs,
    device_index,
    fit_num_stages,
    shared_memory_budget,
    w8a8_config,
)
from moeserve.kernels.targets import require_launchable

if TYPE_CHECKING:
    from moeserve.kernels.moe_align import AlignedPairs

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    bias_ptr,
    stride_be,
    stride_bn,
    x_scale_ptr,
    w_scale_ptr,
    stride_xsm,
    stride_xsk,
    stride_wse,
    stride_wsp,
    stride_wsn,
    stride_wsk,
    rows_per_part,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    W8A8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
):
    """act[s, n] = silu(hidden[pair_s // top_k] . w_gate[n]) * (hidden[pair_s // top_k] . w_up[n]),
    or ACTIVATION's clamped form of it (`gated_activation`); with HAS_BIAS each product plus its
    expert's bias `[E, 2I]` (gpt-oss) first.

    W8A8: hidden and w13 are FP8; hidden's scales `[T, K / SCALE_K]` are read at the token's row,
    w13's `[E, parts, ...]` at each column (gate n and up I + n may sit in different parts)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(inter_size, BLOCK_N)
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
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
        if W8A8:
            x_scale_ptrs = x_scale_ptr + token * stride_xsm
            w_scale_base = w_scale_ptr + expert * stride_wse
            gate_scale_ptrs = w_scale_base + weight_scale_offsets(
                offs_wn, rows_per_part, stride_wsp, stride_wsn, SCALE_N
            )
            up_scale_ptrs = w_scale_base + weight_scale_offsets(
                offs_wn + inter_size, rows_per_part, stride_wsp, stride_wsn, SCALE_N
            )
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
            if W8A8:
                kb = k0 // SCALE_K
                x_scale = tl.load(x_scale_ptrs + kb * stride_xsk, mask=row_ok, other=0.0)[:, None]
                acc_gate += tl.dot(a, w_gate) * x_scale * tl.load(gate_scale_ptrs + kb * stride_wsk)[None, :]
                acc_up += tl.dot(a, w_up) * x_scale * tl.load(up_scale_ptrs + kb * stride_wsk)[None, :]
            else:
                acc_gate += tl.dot(a, w_gate, input_precision=PRECISION)
                acc_up += tl.dot(a, w_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_hk
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = bias_ptr + expert * stride_be + offs_wn * stride_bn
            acc_gate += tl.load(bias).to(tl.float32)[None, :]
            acc_up += tl.load(bias + inter_size * stride_bn).to(tl.float32)[None, :]
        act = gated_activation(acc_gate, acc_up, ACTIVATION, ALPHA, LIMIT)
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
    bias_ptr,
    stride_be,
    stride_bn,
    x_scale_ptr,
    w_scale_ptr,
    stride_xsm,
    stride_xsk,
    stride_wse,
    stride_wsp,
    stride_wsn,
    stride_wsk,
    rows_per_part,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr,
    W8A8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[pair_s, n] = (act[s] . w2[n] (+ the expert's bias `[E, H]` with HAS_BIAS)) *
    pair_weights[pair_s], for real (non-padding) pairs.

    W8A8: act and w2 are FP8, act's scales `[slots, I / SCALE_K]` read at row s."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(hidden_size, BLOCK_N)
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
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
        if W8A8:
            x_scale_ptrs = x_scale_ptr + offs_m.to(tl.int64) * stride_xsm
            w_scale_ptrs = (
                w_scale_ptr
                + expert * stride_wse
                + weight_scale_offsets(offs_wn, rows_per_part, stride_wsp, stride_wsn, SCALE_N)
            )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_k + k0 < inter_size
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if W8A8:
                kb = k0 // SCALE_K
                scales = (
                    tl.load(x_scale_ptrs + kb * stride_xsk)[:, None] * tl.load(w_scale_ptrs + kb * stride_wsk)[None, :]
                )
                acc += tl.dot(a, w) * scales
            else:
                acc += tl.dot(a, w, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + offs_wn * stride_bn).to(tl.float32)[None, :]
        if HAS_WEIGHTS:
            acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < hidden_size))


def check_moe_call(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None,
    max_programs: int | None,
    weight_dtype: torch.dtype | None = None,
) -> int:
    """Checks shapes, dtypes and devices; returns the alignment's block_m. weight_dtype: the
    weights' dtype (None: hidden's; float8_e4m3fn for the w8a8 path)."""
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
    if weight_dtype is None and (
        hidden.dtype not in SUPPORTED_DTYPES or w13.dtype != hidden.dtype or w2.dtype != hidden.dtype
    ):
        raise ValueError(
            f"hidden, w13, w2 must share one of {SUPPORTED_DTYPES}; got {hidden.dtype}, {w13.dtype}, {w2.dtype}"
        )
    if weight_dtype is not None and (
        hidden.dtype not in SUPPORTED_DTYPES or w13.dtype != weight_dtype or w2.dtype != weight_dtype
    ):
        raise ValueError(
            f"hidden must be one of {SUPPORTED_DTYPES} and w13, w2 {weight_dtype}; got {hidden.dtype}, "
            f"{w13.dtype}, {w2.dtype}"
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


@dataclass(frozen=True)
class W8A8Scales:
    """The scales of a w8a8 `launch_fused_moe`, whose hidden, w13 and w2 are then float8_e4m3fn.

    hidden: float32 `[T_rows, ceil(H / block[1])]`, hidden's per-token-group scales (`fp8_quant`).
    w13, w2: the weights' `BlockFP8Weight.scale_inv`, `[E, parts, grid rows, grid cols]`.
    block: the weights' scale tile; block[1] is also the activations' group along K.
    """

    hidden: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int]


def _scale_args(rows: torch.Tensor, weight_scales: torch.Tensor, weight: torch.Tensor) -> tuple:
    """The kernels' scale arguments: pointers, strides, and rows per part of the weight."""
    return (rows, weight_scales, *rows.stride(), *weight_scales.stride(), weight.shape[1] // weight_scales.shape[1])


def _bias_args(bias: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """A kernel's bias arguments: pointer and strides, never read without one (HAS_BIAS off)."""
    return (dummy, 0, 0) if bias is None else (bias, *bias.stride())


def check_biases(hidden: torch.Tensor, w13: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """gpt-oss's expert biases: b13 `[E, 2I]` and b2 `[E, H]` in hidden's dtype, on its device."""
    if biases is None:
        return
    (num_experts, two_inter, hidden_size), (b13, b2) = w13.shape, biases
    if b13.shape != (num_experts, two_inter) or b2.shape != (num_experts, hidden_size):
        raise ValueError(
            f"biases must be b13 [{num_experts}, {two_inter}] and b2 [{num_experts}, {hidden_size}]; got "
            f"{list(b13.shape)} and {list(b2.shape)}"
        )
    for name, b in (("b13", b13), ("b2", b2)):
        if b.dtype != hidden.dtype or b.device != hidden.device:
            raise ValueError(f"{name} must be {hidden.dtype} on {hidden.device}, got {b.dtype} on {b.device}")


def _no_scale_args(dummy: torch.Tensor) -> tuple:
    """The scale arguments of a dense launch: never read (W8A8 is off)."""
    return (dummy, dummy, 0, 0, 0, 0, 0, 0, 1)


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
    activation: GatedActivation | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Expert outputs of every (row, k) pair: `[T_rows * top_k, H]` in hidden's dtype.

    hidden `[T_rows, H]`; w13 `[E, 2I, H]` (gate rows then up rows); w2 `[E, H, I]`; `aligned` =
    `moe_align_block_size(topk_ids [T_rows, top_k], E, block_m_for(T_rows, top_k, E))`. Row p is
    expert(p's expert)(hidden[p // top_k]) times `pair_weights[p]` (float32 `[T_rows * top_k]`) if
    given; rows of pairs the alignment skipped (expert ids outside [0, E)) are zero. With EP = 1 the
    token's output is `out.view(T, K, H).sum(1)`; after an EP dispatch (top_k = 1) row p is
    dispatched row p's output. Accumulates in fp32 (exact fp32 dots for fp32 inputs, no tf32); the
    activation between the GEMMs is rounded to hidden's dtype. `max_programs` caps each kernel's
    persistent grid (default: one program per SM) so the other SMs stay free. `activation`: the
    gated activation between the GEMMs (None: silu(gate) * up). `biases`: (b13 `[E, 2I]`,
    b2 `[E, H]`), each expert's biases of its gate/up and down products (gpt-oss), the down
    bias added before the pair's weight.
    """
    block_m = check_moe_call(hidden, w13, w2, aligned, top_k, pair_weights, max_programs)
    check_biases(hidden, w13, biases)
    return launch_fused_moe(
        hidden, w13, w2, aligned, top_k, block_m, hidden.dtype, pair_weights, max_programs, None, activation, biases
    )


def launch_fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    block_m: int,
    out_dtype: torch.dtype,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
    w8a8: W8A8Scales | None = None,
    activation: GatedActivation | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Both kernels on arguments `check_moe_call` has passed; the activation between them is
    `out_dtype`. With `w8a8` it is then quantized per token group (its live rows only, bounded
    on the device by `aligned.num_padded`) for the FP8 down GEMM."""
    require_launchable(hidden, "fused_moe")
    cfg = config_for_block_m(block_m)
    if w8a8 is not None:
        cfg = w8a8_config(cfg, w8a8.block[1])
    num_experts, two_inter, hidden_size = w13.shape
    inter_size = two_inter // 2
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(num_pairs, hidden_size, dtype=out_dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    num_slots = aligned.sorted_pair_ids.numel()
    act = torch.empty(num_slots, inter_size, dtype=out_dtype, device=hidden.device)
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
        W8A8=w8a8 is not None,
        SCALE_N=1 if w8a8 is None else w8a8.block[0],
        SCALE_K=1 if w8a8 is None else w8a8.block[1],
        HAS_BIAS=biases is not None,
        num_warps=cfg.num_warps,
    )
    budget = shared_memory_budget(device_index(hidden.device)) if hidden.device.type == "cuda" else SM90_SHARED_MEMORY

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
        *_bias_args(None if biases is None else biases[0], hidden),
        *(_no_scale_args(hidden) if w8a8 is None else _scale_args(w8a8.hidden, w8a8.w13, w13)),
        EVEN_K=hidden_size % cfg.block_k == 0,
        num_stages=fit_num_stages(cfg, hidden.element_size(), 2, budget),
        **activation_constants(activation),
        **launch,
    )
    down_scales = _no_scale_args(act)
    if w8a8 is not None:
        act, act_scales = per_token_group_quant(act, w8a8.block[1], aligned.num_padded)
        down_scales = _scale_args(act_scales, w8a8.w2, w2)
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
        *_bias_args(None if biases is None else biases[1], out),
        *down_scales,
        EVEN_K=inter_size % cfg.block_k == 0,
        HAS_WEIGHTS=pair_weights is not None,
        num_stages=fit_num_stages(cfg, act.element_size(), 1, budget),
        **launch,
    )
    return out


def pairs_by_expert(aligned: AlignedPairs, num_pairs: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, the ids of the (token, k) pairs routed to it) for every expert the aligned
    layout gives pairs: how the torch references walk what the kernels compute block by block."""
    block_m = aligned.sorted_pair_ids.numel() // aligned.block_experts.numel()
    ids = aligned.sorted_pair_ids.long()
    slot_expert = aligned.block_experts.long().repeat_interleave(block_m)
    live = ids < num_pairs
    for expert in torch.unique(slot_expert[live]).tolist():
        yield expert, ids[live & (slot_expert == expert)]


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
    activation: GatedActivation | None = None,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Torch version of `fused_moe`, one expert at a time, what the kernels are tested against.

    Computes in fp32 and rounds the activation (the torch path's `gated`) to hidden's dtype as
    the kernel stores it.
    `max_programs` only exists for signature parity: there is no grid here.
    """
    check_moe_call(hidden, w13, w2, aligned, top_k, pair_weights, max_programs)
    check_biases(hidden, w13, biases)
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(num_pairs, w13.shape[2], dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    for expert, pairs in pairs_by_expert(aligned, num_pairs):
        b13, b2 = (None, None) if biases is None else (b[expert].float() for b in biases)
        x = hidden[pairs // top_k].float()
        gate, up = F.linear(x, w13[expert].float(), b13).chunk(2, dim=-1)
        act = gated(gate, up, activation).to(hidden.dtype).float()
        y = F.linear(act, w2[expert].float(), b2)
        if pair_weights is not None:
            y = y * pair_weights[pairs, None]
        out[pairs] = y.to(hidden.dtype)
    return out
