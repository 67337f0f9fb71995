"""Block-scaled FP8 linear (w8a8): `y = x W^T` with W as stored in an FP8 checkpoint.

W `[out, in]` is float8_e4m3fn with one float32 scale per `block` tile (one grid per part of a
fused parameter, `BlockFP8Weight`); x is quantized per token and per group of `block[1]` columns
(`fp8_quant`). Each K tile of the GEMM is an FP8 dot accumulated in fp32, multiplied by its rows'
activation scales and its columns' weight scales, then added to the fp32 accumulator; the K tile
never straddles a scale block. What DeepSeek-V3's inference code does, minus its requirement
that every dimension be a multiple of 128: partial tiles are masked (rows, K) or wrapped (columns).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.fp8_format import FP8_DTYPE, BlockFP8Weight
from moeserve.kernels.fp8_quant import (
    ACTIVATION_DTYPES,
    check_group,
    dequantize_groups,
    per_token_group_quant,
    per_token_group_quant_reference,
)
from moeserve.kernels.gemm_tiles import tile_coords, weight_scale_offsets
from moeserve.kernels.launch_config import (
    SM90_SHARED_MEMORY,
    KernelConfig,
    device_index,
    fit_num_stages,
    shared_memory_budget,
)

# (largest number of rows, config), first match wins; block_k is cut to the scale block. Decode
# (few rows) is bound by reading W: narrow column tiles spread it over more SMs. Prefill is bound
# by the tensor cores: large tiles. Starting points for an H100, to retune with bench/fp8_gemm.py.
LINEAR_CONFIGS: tuple[tuple[float, KernelConfig], ...] = (
    (16, KernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)),
    (32, KernelConfig(block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=4)),
    (64, KernelConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=4, num_stages=4)),
    (float("inf"), KernelConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3)),
)


def linear_config(num_rows: int, group: int) -> KernelConfig:
    """The launch config for `num_rows` rows, its K tile cut to the scale block `group`."""
    cfg = next(cfg for limit, cfg in LINEAR_CONFIGS if num_rows <= limit)
    return dataclasses.replace(cfg, block_k=min(cfg.block_k, group))


@triton.jit
def _w8a8_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    num_rows,
    num_cols,
    depth,
    rows_per_part,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_wn,
    stride_wk,
    stride_wsp,
    stride_wsn,
    stride_wsk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """out[m, n] = sum over K tiles k of (a[m, k] . w[n, k]) * a_scale[m, k // SCALE_K] * w_scale(n, k)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), tl.cdiv(num_cols, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < num_rows
    offs_m = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % num_cols  # wrap instead of masking: the extra columns are never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + offs_wn[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    w_scale_ptrs = w_scale_ptr + weight_scale_offsets(offs_wn, rows_per_part, stride_wsp, stride_wsn, SCALE_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k + k0 < depth
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        kb = k0 // SCALE_K
        a_scale = tl.load(a_scale_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
        acc += tl.dot(a, w) * a_scale[:, None] * tl.load(w_scale_ptrs + kb * stride_wsk)[None, :]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < num_cols))


def _check(x: torch.Tensor, weight: BlockFP8Weight) -> None:
    if weight.data.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [T, in] and a weight [out, in]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if weight.data.device != x.device or weight.scale_inv.device != x.device:
        raise ValueError(f"the weight is on {weight.data.device}, x on {x.device}")
    check_group(weight.block[1])


def w8a8_linear(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    """x `[T, in]` (fp16, bf16 or fp32) times an FP8 weight `[out, in]` transposed -> `[T, out]` in
    x's dtype; x is quantized per token group first (no bias: the caller adds it)."""
    _check(x, weight)
    q, scales = per_token_group_quant(x, weight.block[1])
    num_rows, depth = x.shape
    num_cols = weight.shape[0]
    out = torch.empty(num_rows, num_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    cfg = linear_config(num_rows, weight.block[1])
    budget = shared_memory_budget(device_index(x.device)) if x.is_cuda else SM90_SHARED_MEMORY
    w, w_scales = weight.data, weight.scale_inv
    grid = (triton.cdiv(num_rows, cfg.block_m) * triton.cdiv(num_cols, cfg.block_n),)
    _w8a8_kernel[grid](
        q,
        scales,
        w,
        w_scales,
        out,
        num_rows,
        num_cols,
        depth,
        weight.rows_per_part,
        q.stride(0),
        q.stride(1),
        scales.stride(0),
        scales.stride(1),
        w.stride(0),
        w.stride(1),
        *w_scales.stride(),
        out.stride(0),
        out.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SCALE_N=weight.block[0],
        SCALE_K=weight.block[1],
        EVEN_K=depth % cfg.block_k == 0,
        num_warps=cfg.num_warps,
        num_stages=fit_num_stages(cfg, FP8_DTYPE.itemsize, 1, budget),
    )
    return out


def w8a8_linear_reference(x: torch.Tensor, weight: BlockFP8Weight) -> torch.Tensor:
    """Torch version of `w8a8_linear`, what the kernel is tested against: x quantized per token
    group exactly as the kernel does, both operands dequantized, one fp32 matmul."""
    _check(x, weight)
    x_values = dequantize_groups(*per_token_group_quant_reference(x, weight.block[1]), weight.block[1])
    return F.linear(x_values, weight.dequantize(torch.float32)).to(x.dtype)
