"""Block-quantized FP8 weights: the published format's arithmetic, and parameters kept in it.

A weight `[out, in]` is stored as float8_e4m3fn with float32 inverse scales
`[ceil(out/bo), ceil(in/bi)]`, one per `(bo, bi)` tile (the last row and column of tiles may be
partial); its value is `weight.float() * scale_inv` over each tile (DeepSeek-V3, Qwen3-FP8).

In memory a quantized parameter keeps its FP8 bytes and its scales, and the torch path
dequantizes it each time a layer reads it, in the layer's compute dtype: the parameter is
wrapped in a `torch.nn.utils.parametrize` parametrization, so every layer keeps reading
`self.weight` / `self.w13` unchanged. Our fused parameters concatenate several checkpoint
tensors (gate and up) whose tiles need not meet at a tile boundary, so the scales keep one
grid per part: `[..., parts, ceil(rows/bo), ceil(cols/bi)]` for a parameter `[..., parts * rows,
cols]` (`...`: the stacked experts).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`


def scale_name(weight_name: str) -> str:
    """The checkpoint name of a quantized weight's inverse scales."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` (`[..., rows, cols]`): partial tiles count."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [out, in]` -> (float8_e4m3fn `[out, in]`, float32 scale_inv grid): each tile's
    largest magnitude maps to the format's largest value, as the published checkpoints do."""
    rows, cols = weight.shape
    grid_rows, grid_cols = scale_shape(weight.shape, block)
    padded = weight.new_zeros(grid_rows * block[0], grid_cols * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid_rows, block[0], grid_cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scale_inv


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """`weight [..., parts * rows, cols]` FP8 with `scale_inv [..., parts, grid_rows, grid_cols]`
    -> the values in `dtype` (computed in float32, then cast)."""
    *lead, all_rows, cols = weight.shape
    parts = scale_inv.shape[-3]
    rows = all_rows // parts
    scale = scale_inv.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    values = weight.float().reshape(*lead, parts, rows, cols) * scale
    return values.reshape(*lead, all_rows, cols).to(dtype)


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
    scales = torch.empty(*old.shape[:-2], parts, *grid, dtype=torch.float32, device=old.device)
    setattr(module, name, storage)
    # unsafe: the parametrization changes the dtype (FP8 storage, compute-dtype reads).
    parametrize.register_parametrization(module, name, BlockFP8(scales, block, old.dtype), unsafe=True)
    param_list = module.parametrizations[name]
    return param_list.original, param_list[0].scale_inv
