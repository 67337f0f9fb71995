"""The fused MoE with block-scaled FP8 experts (w8a8), as DeepSeek-V3 and Qwen3-FP8 are served.

The experts' weights stay as stored (float8_e4m3fn, one float32 scale per tile, gate and up
with a scale grid each); the rows are quantized per token and per group of `block[1]` columns
(`fp8_quant`), and both GEMMs run on FP8 operands with fp32 accumulation, each K tile's partial
product multiplied by `row scale * column scale` (`fused_moe`'s kernels with W8A8 set). The
activation between the GEMMs is rounded to hidden's dtype, then quantized the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moeserve.config import GatedActivation
from moeserve.fp8_format import FP8_DTYPE, BlockFP8Weight
from moeserve.gated_activation import gated
from moeserve.kernels.fp8_quant import (
    check_group,
    dequantize_groups,
    per_token_group_quant,
    per_token_group_quant_reference,
)
from moeserve.kernels.fused_moe import W8A8Scales, check_moe_call, launch_fused_moe, pairs_by_expert

if TYPE_CHECKING:
    from moeserve.kernels.moe_align import AlignedPairs


def _check_weights(w13: BlockFP8Weight, w2: BlockFP8Weight) -> None:
    if w13.block != w2.block:
        raise ValueError(f"w13 and w2 must share one FP8 block, got {w13.block} and {w2.block}")
    check_group(w13.block[1])
    if w13.data.dim() != 3 or w2.data.dim() != 3:
        raise ValueError(f"need stacked experts w13 [E, 2I, H], w2 [E, H, I]; got {w13.shape}, {w2.shape}")


def fused_moe_w8a8(
    hidden: torch.Tensor,
    w13: BlockFP8Weight,
    w2: BlockFP8Weight,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    max_programs: int | None = None,
    hidden_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """`fused_moe` with FP8 experts: `[T_rows * top_k, H]` in hidden's dtype.

    hidden `[T_rows, H]` (fp16, bf16 or fp32), quantized here per token group, unless
    `hidden_fp8` gives it quantized already: (float8_e4m3fn `[T_rows, H]`, float32 scales
    `[T_rows, ceil(H / block_k)]`), groups of the weights' K block (an FP8 dispatch's rows);
    w13 data `[E, 2I, H]` with scales `[E, parts, ...]`, w2 data `[E, H, I]` with scales
    `[E, 1, ...]` (`BlockFP8Weight`); `aligned`, `top_k`, `pair_weights`, `max_programs`,
    `activation` as for `fused_moe`.
    """
    _check_weights(w13, w2)
    block_m = check_moe_call(
        hidden, w13.data, w2.data, aligned, top_k, pair_weights, max_programs, weight_dtype=FP8_DTYPE
    )
    if hidden_fp8 is None:
        hidden_q, hidden_scales = per_token_group_quant(hidden, w13.block[1])
    else:
        hidden_q, hidden_scales = _check_quantized(hidden, hidden_fp8, w13.block[1])
    scales = W8A8Scales(hidden_scales, w13.scale_inv, w2.scale_inv, w13.block)
    return launch_fused_moe(
        hidden_q,
        w13.data,
        w2.data,
        aligned,
        top_k,
        block_m,
        hidden.dtype,
        pair_weights,
        max_programs,
        scales,
        activation,
    )


def _check_quantized(
    hidden: torch.Tensor, hidden_fp8: tuple[torch.Tensor, torch.Tensor], group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`hidden_fp8`, checked to be `hidden`'s rows quantized in groups of `group` channels."""
    q, scales = hidden_fp8
    rows, cols = hidden.shape
    want = (rows, -(-cols // group))
    if q.dtype != FP8_DTYPE or q.shape != hidden.shape or scales.dtype != torch.float32 or scales.shape != want:
        raise ValueError(
            f"hidden_fp8 must be float8_e4m3fn {list(hidden.shape)} and float32 scales {list(want)}; "
            f"got {q.dtype} {list(q.shape)} and {scales.dtype} {list(scales.shape)}"
        )
    if q.device != hidden.device or scales.device != hidden.device:
        raise ValueError(f"hidden_fp8 is on {q.device} / {scales.device}, hidden on {hidden.device}")
    return q.contiguous(), scales.contiguous()


def _fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x's values after per-token-group quantization, in float32."""
    return dequantize_groups(*per_token_group_quant_reference(x, group), group)


def fused_moe_w8a8_reference(
    hidden: torch.Tensor,
    w13: BlockFP8Weight,
    w2: BlockFP8Weight,
    aligned: AlignedPairs,
    top_k: int,
    pair_weights: torch.Tensor | None = None,
    hidden_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation: GatedActivation | None = None,
) -> torch.Tensor:
    """Torch version of `fused_moe_w8a8`, one expert at a time, what the kernels are tested
    against: the rows quantized per token group exactly as the kernel does (or `hidden_fp8`'s),
    then dequantized, weights dequantized, fp32 matmuls; the activation rounded to hidden's
    dtype and quantized again before the down projection."""
    _check_weights(w13, w2)
    check_moe_call(hidden, w13.data, w2.data, aligned, top_k, pair_weights, None, weight_dtype=FP8_DTYPE)
    group = w13.block[1]
    num_pairs = hidden.shape[0] * top_k
    out = torch.zeros(num_pairs, w13.shape[2], dtype=hidden.dtype, device=hidden.device)
    if num_pairs == 0:
        return out
    if hidden_fp8 is None:
        x_all = _fake_quant(hidden, group)
    else:
        x_all = dequantize_groups(*_check_quantized(hidden, hidden_fp8, group), group)
    w13_values, w2_values = w13.dequantize(torch.float32), w2.dequantize(torch.float32)
    for expert, pairs in pairs_by_expert(aligned, num_pairs):
        gate, up = F.linear(x_all[pairs // top_k], w13_values[expert]).chunk(2, dim=-1)
        act = _fake_quant(gated(gate, up, activation).to(hidden.dtype), group)
        y = F.linear(act, w2_values[expert])
        if pair_weights is not None:
            y = y * pair_weights[pairs, None]
        out[pairs] = y.to(hidden.dtype)
    return out
