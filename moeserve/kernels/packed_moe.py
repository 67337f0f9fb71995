"""Grouped GEMMs over packed 4-bit experts: compressed-tensors INT4 (W4A16), ModelOpt NVFP4 and
MXFP4 (DeepSeek-V4's FP4 experts), each weight tile dequantized in registers from the stored
bytes (the experts stay packed in memory: a tile of codes and its scales is all a GEMM reads of
them).

The pairs arrive aligned as for `fused_moe` (`AlignedPairs`): every BLOCK_M rows of the sorted
order belong to one expert. The activations stay in the compute dtype (bf16 rows, as a dispatch
delivers them), so NVFP4 and MXFP4 run as weight-only too: Hopper has no FP4 units at all, and
Blackwell's take FP4 activations, which a bf16 dispatch does not carry. Per K tile the kernel
loads the codes (INT4: the int32 word holding each column's nibble; NVFP4, MXFP4: its byte), the
group scales of those columns (MXFP4's e8m0 bytes become `2 ** (byte - 127)`) and, for NVFP4,
the part's global scale (gate and up have their own), turns them into values in float32, rounds
them to the rows' dtype and runs the tile's dot with float32 accumulation.

Two launches make the MoE: gate/up (rows gathered from hidden by pair // top_k, outputs stored by
sorted position), SiLU-and-multiply, then down (rows by sorted position, each output scaled by its
pair's combine weight and scattered to the pair's row), as `fused_moe_reference` computes it.
The activation (SiLU or a clamped kind, the torch path's `gated`) runs between the launches,
on the gate/up outputs in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moeserve.config import GatedActivation
from moeserve.gated_activation import gated
from moeserve.kernels.fused_moe import pairs_by_expert
from moeserve.kernels.gemm_tiles import aligned_tile
from moeserve.kernels.launch_config import default_max_programs
from moeserve.kernels.targets import require_launchable
from moeserve.packed_weight import PackedExperts

if TYPE_CHECKING:
    from moeserve.kernels.moe_align import AlignedPairs

# K tiles of 32: the tile's codes, scales and decoded values live in registers beside the
# accumulator, and at 64 the NVFP4 decode spilled (~670 B per thread at sm_90, compile check).
BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS = 64, 32, 8, 4


@triton.jit
def _e2m1(nibble):
    """An e2m1 code's value: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa."""
    magnitude = nibble & 7
    exponent = magnitude >> 1
    mantissa = (magnitude & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
    value = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where(nibble >= 8, -value, value)


@triton.jit
def _packed_gemm_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    global_ptr,
    out_ptr,
    pair_weights_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    n_size,
    k_size,
    rows_per_part,
    stride_xm,
    stride_xk,
    stride_ce,
    stride_cn,
    stride_ck,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ge,
    stride_gp,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GROUP: tl.constexpr,
    NVFP4: tl.constexpr,
    MXFP4: tl.constexpr,
    DOWN: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[r] = x[r'] . W_e^T for the sorted slots of live tiles. Gate/up (DOWN off): x row
    pair // top_k, out row the sorted slot; down: x row the sorted slot, out row the pair, times
    its combine weight with HAS_WEIGHTS."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M)
    num_pid_n = tl.cdiv(n_size, BLOCK_N)
    for tile in range(pid, num_pid_m * num_pid_n, tl.num_programs(0)):
        pid_n, slots, pair, row_ok, expert = aligned_tile(
            tile, num_pid_m, num_pid_n, sorted_ids_ptr, block_experts_ptr, num_pairs, BLOCK_M, GROUP_M
        )
        x_rows = slots.to(tl.int64) if DOWN else (pair // top_k).to(tl.int64)
        out_rows = pair.to(tl.int64) if DOWN else slots.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_size
        n = offs_n[:, None].to(tl.int64)
        codes_rows = codes_ptr + expert * stride_ce + n * stride_cn
        scales_rows = scales_ptr + expert * stride_se + n * stride_sn
        if NVFP4:  # each output feature's part (gate or up) has its own global scale
            part_scale = tl.load(global_ptr + expert * stride_ge + (offs_n // rows_per_part) * stride_gp, mask=n_ok)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_size, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_size
            x = tl.load(
                x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_ok = n_ok[:, None] & k_ok[None, :]
            scale_ptrs = scales_rows + (offs_k // GROUP)[None, :] * stride_sk
            if MXFP4:  # e8m0: the byte is the exponent, biased by 127
                w = tl.exp2(tl.load(scale_ptrs, mask=w_ok, other=0).to(tl.float32) - 127.0)
            else:
                w = tl.load(scale_ptrs, mask=w_ok, other=0.0).to(tl.float32)
            if NVFP4 or MXFP4:
                byte = tl.load(codes_rows + (offs_k // 2)[None, :] * stride_ck, mask=w_ok, other=0).to(tl.int32)
                w = w * _e2m1((byte >> ((offs_k % 2) * 4)[None, :]) & 15)
                if NVFP4:
                    w = w * part_scale[:, None]
            else:
                word = tl.load(codes_rows + (offs_k // 8)[None, :] * stride_ck, mask=w_ok, other=0)
                w = w * ((((word >> ((offs_k % 8) * 4)[None, :]) & 15) - 8).to(tl.float32))
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
        if HAS_WEIGHTS:
            acc = acc * tl.load(pair_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        out = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _launch(
    x: torch.Tensor,
    weights: PackedExperts,
    out: torch.Tensor,
    aligned: AlignedPairs,
    num_pairs: int,
    top_k: int,
    down: bool,
    pair_weights: torch.Tensor | None,
    max_programs: int,
) -> None:
    block_m = aligned.sorted_pair_ids.numel() // aligned.block_experts.numel()
    _, n_size, k_size = weights.shape
    global_scales = weights.global_scales if weights.nvfp4 else weights.scales  # unread without NVFP4
    parts = global_scales.shape[1] if weights.nvfp4 else 1
    grid = (min(max_programs, aligned.block_experts.numel() * triton.cdiv(n_size, BLOCK_N)),)
    _packed_gemm_kernel[grid](
        x, weights.codes, weights.scales, global_scales, out,
        pair_weights if pair_weights is not None else out,
        aligned.sorted_pair_ids, aligned.block_experts, aligned.num_padded,
        num_pairs, top_k, n_size, k_size, n_size // parts,
        x.stride(0), x.stride(1), *weights.codes.stride(), *weights.scales.stride(),
        global_scales.stride(0), global_scales.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, GROUP=weights.group,
        NVFP4=weights.nvfp4, MXFP4=weights.mxfp4, DOWN=down, HAS_WEIGHTS=pair_weights is not None,
        # fp32 stays exact (no tf32), like torch's default matmul: a checking dtype, not a serving one.
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )  # fmt: skip


def _check(hidden: torch.Tensor, w13: PackedExperts, w2: PackedExperts, pair_weights: torch.Tensor | None) -> None:
    experts, two_inter, hidden_size = w13.shape
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size or w2.shape != (experts, hidden_size, two_inter // 2):
        raise ValueError(f"inconsistent shapes: hidden {tuple(hidden.shape)}, w13 {w13.shape}, w2 {w2.shape}")
    if (w13.nvfp4, w13.mxfp4) != (w2.nvfp4, w2.mxfp4):
        raise ValueError("w13 and w2 must be stored in one format")
    if pair_weights is not None and pair_weights.dtype != torch.float32:
        raise ValueError(f"pair_weights must be float32, got {pair_weights.dtype}")


def packed_moe(
    hidden: torch.Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """Every routed expert's gated MLP over packed experts: `[T_rows * top_k, H]` in hidden's
    dtype; arguments as for `fused_moe`, w13 `[E, 2I, H]` and w2 `[E, H, I]` packed."""
    _check(hidden, w13, w2, pair_weights)
    require_launchable(hidden, "packed_moe")
    num_pairs = hidden.shape[0] * top_k
    hidden_size = hidden.shape[1]
    out = torch.zeros(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    programs = max_programs if max_programs is not None else default_max_programs(hidden.device)
    gate_up = torch.empty(aligned.sorted_pair_ids.numel(), w13.shape[1], dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, gate_up, aligned, num_pairs, top_k, False, None, programs)
    gate, up = gate_up.chunk(2, dim=-1)
    act = gated(gate.float(), up.float(), activation).to(hidden.dtype)
    _launch(act, w2, out, aligned, num_pairs, top_k, True, pair_weights, programs)
    return out


def packed_moe_reference(
    hidden: torch.Tensor,
    w13: PackedExperts,
    w2: PackedExperts,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """Torch version of `packed_moe`, one expert at a time, what the kernels are tested against:
    the weights dequantized by the formats' own code and rounded to hidden's dtype as the kernel
    rounds its tiles, fp32 matmuls, gate/up outputs and the activation rounded to hidden's dtype."""
    _check(hidden, w13, w2, pair_weights)
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(num_pairs, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    w13_values = w13.dequantize(torch.float32).to(hidden.dtype).float()
    w2_values = w2.dequantize(torch.float32).to(hidden.dtype).float()
    for expert, pairs in pairs_by_expert(aligned, num_pairs):
        gate_up = F.linear(hidden[pairs // top_k].float(), w13_values[expert]).to(hidden.dtype).float()
        gate, up = gate_up.chunk(2, dim=-1)
        y = F.linear(gated(gate, up, activation).to(hidden.dtype).float(), w2_values[expert])
        if pair_weights is not None:
            y = y * pair_weights[pairs, None]
        out[pairs] = y.to(hidden.dtype)
    return out
