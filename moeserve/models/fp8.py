"""Block-quantized FP8 weights: the published format's arithmetic, and parameters kept in it.

A weight `[out, in]` is stored as float8_e4m3fn with inverse scales `[ceil(out/bo), ceil(in/bi)]`,
one per `(bo, bi)` tile (the last row and column of tiles may be partial); its value is
`weight.float() * scale_inv` over each tile (DeepSeek-V3, Qwen3-FP8). Releases store the scales
in float32, bfloat16 or float16; they are held in float32 (`SCALE_DTYPE`), which holds each exactly.

In memory a quantized parameter keeps its FP8 bytes and its scales, wrapped in a
`torch.nn.utils.parametrize` parametrization that dequantizes on read, in the layer's compute
dtype: whatever reads `self.weight` / `self.w13` gets ordinary values. The GEMMs read past it:
layers hand `stored_weight(...)` to the ops backend, which gets the FP8 bytes and scales as a
`BlockFP8Weight` and decides itself (dequantize at use on the torch path, a w8a8 GEMM on the
Triton path). Our fused parameters concatenate several checkpoint
tensors (gate and up) whose tiles need not meet at a tile boundary, so the scales keep one
grid per part: `[..., parts, ceil(rows/bo), ceil(cols/bi)]` for a parameter `[..., parts * rows,
cols]` (`...`: the stacked experts).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from moeserve.fp8_format import FP8_DTYPE, SCALE_DTYPE, BlockFP8Weight, dequantize
from moeserve.models.packed import PackedWeight
from moeserve.packed_weight import PackedExperts


class BlockFP8(nn.Module):
    """The parametrization of one quantized parameter: holds its scales (a parameter, so that
    whatever moves a module's parameters, such as an expert rebalance, moves them too) and
    turns the FP8 original into `dtype` on every read."""

    def __init__(self, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.scale_inv = nn.Parameter(scale_inv, requires_grad=False)
        self.block = block
        self.dtype = dtype

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return dequantize(weight, self.scale_inv, self.block, self.dtype)


def quantize_parameter(
    module: nn.Module, name: str, parts: int, block: tuple[int, int], grid: tuple[int, int]
) -> tuple[nn.Parameter, nn.Parameter]:
    """Replace `module.<name>` by FP8 storage of its shape with `parts` scale grids of `grid`
    each; the read value keeps the old parameter's dtype and tensor-parallel tag. Returns
    (FP8 storage, scales) for the loader to fill."""
    old = getattr(module, name)
    storage = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False)
    if hasattr(old, "tp_shard"):
        storage.tp_shard = old.tp_shard  # type: ignore[attr-defined]
    scales = torch.empty(*old.shape[:-2], parts, *grid, dtype=SCALE_DTYPE, device=old.device)
    setattr(module, name, storage)
    # unsafe: the parametrization changes the dtype (FP8 storage, compute-dtype reads).
    parametrize.register_parametrization(module, name, BlockFP8(scales, block, old.dtype), unsafe=True)
    param_list = module.parametrizations[name]
    return param_list.original, param_list[0].scale_inv


def stored_weight(module: nn.Module, name: str) -> torch.Tensor | BlockFP8Weight | PackedExperts:
    """`module.<name>` as stored: a `BlockFP8Weight` of its FP8 bytes and scales if it is
    block-quantized FP8, `PackedExperts` of its codes and scales if it is INT4 or NVFP4 (neither
    dequantized), else what reading it gives (the parameter, or MXFP4's dequantized values)."""
    # Read from `_modules` rather than through `parametrize.is_parametrized`: this runs for every
    # GEMM of every step, and on an unquantized module that asks for a missing attribute, an
    # AttributeError raised and caught each time (3x the cost of reading the weight).
    parametrizations = module._modules.get("parametrizations")
    param_list = None if parametrizations is None else parametrizations._modules.get(name)
    if param_list is not None and isinstance(param_list[0], PackedWeight):
        packed = param_list[0].fmt.packed_experts(param_list.original, param_list[0].held())
        return getattr(module, name) if packed is None else packed
    if param_list is None or not isinstance(param_list[0], BlockFP8):
        return getattr(module, name)
    return BlockFP8Weight(param_list.original, param_list[0].scale_inv, param_list[0].block)
