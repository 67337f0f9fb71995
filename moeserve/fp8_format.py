"""The FP8 block-quantized checkpoint format as DeepSeek-V3 and Qwen3-FP8 publish it: e4m3 weights
with one float32 inverse scale per 128x128 tile (`<weight>_scale_inv`), partial edge tiles included.

Its own module because both sides of the format need it and neither may import the other: the
loader's in-memory form (`models/fp8.py`) and the tiny-checkpoint writer (`checkpoints/`).
"""

from __future__ import annotations

import torch

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
