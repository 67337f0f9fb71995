"""The FP8 block-quantized checkpoint format as DeepSeek-V3 and Qwen3-FP8 publish it: e4m3 weights
with one inverse scale per 128x128 tile (`<weight>_scale_inv`), partial edge tiles included. The
scales are stored float32 (DeepSeek-V3), bfloat16 (Qwen3-1.7B-FP8, Qwen3-32B-FP8) or float16
(Qwen3-4B-Instruct-2507-FP8); every one of those is exact in float32, the one dtype they are held
in once read. DeepSeek-V3.1 and V4 declare `scale_fmt: ue8m0`: every scale a power of two, which
V4's FP4-expert releases store as e8m0 exponent bytes (float8_e8m0fnu) under `<module>.scale`.

Its own module because both sides of the format need it and neither may import the other: the
loader's in-memory form (`models/fp8.py`) and the tiny-checkpoint writer (`checkpoints/`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`
RELEASED_V4_SCALE = ".scale"  # DeepSeek-V4's release names them by module: `x.weight` -> `x.scale`
SCALE_DTYPE = torch.float32  # scales in memory, whatever float dtype the checkpoint stored


def scale_name(weight_name: str) -> str:
    """The checkpoint name of a quantized weight's inverse scales."""
    return weight_name + SCALE_SUFFIX


def released_v4_scale_name(weight_name: str) -> str:
    """The name DeepSeek-V4's release gives a weight's scales (the same values as `scale_name`'s)."""
    return weight_name.removesuffix(".weight") + RELEASED_V4_SCALE


def is_power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """bool, per entry: a positive finite power of two (what a `ue8m0` scale must be)."""
    mantissa, _ = torch.frexp(scales.float())
    return torch.isfinite(scales.float()) & (mantissa == 0.5)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` (`[..., rows, cols]`): partial tiles count."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def quantize(
    weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = SCALE_DTYPE, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [out, in]` -> (float8_e4m3fn `[out, in]`, scale_inv grid in `scale_dtype`): each
    tile's largest magnitude maps to the format's largest value, as the published checkpoints do.
    A narrower `scale_dtype` rounds the scale first and the tile is divided by the rounded one,
    so that the stored pair means what was quantized, as a bf16-scaled release's does. With
    `ue8m0` each scale rounds up to a power of two (nothing saturates), as V3.1's and V4's do."""
    rows, cols = weight.shape
    grid_rows, grid_cols = scale_shape(weight.shape, block)
    padded = weight.new_zeros(grid_rows * block[0], grid_cols * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.reshape(grid_rows, block[0], grid_cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    # Clamped to the dtype's smallest normal: an all-zero tile's scale must stay nonzero in fp16 too.
    scale_inv = amax / FP8_MAX
    if ue8m0:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    scale_inv = scale_inv.to(scale_dtype).clamp(min=torch.finfo(scale_dtype).tiny)
    q = (tiles / scale_inv.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
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


@dataclass(frozen=True)
class BlockFP8Weight:
    """A quantized weight as an FP8 GEMM takes it: the stored bytes and their scales, not a
    dequantized copy (what makes w8a8 worth it: half the bytes read of bf16).

    data: float8_e4m3fn `[..., parts * rows, cols]` (`...`: stacked experts, if any).
    scale_inv: float32 `[..., parts, ceil(rows / block[0]), ceil(cols / block[1])]`: one grid per
      part, since a fused parameter (gate then up) concatenates checkpoint tensors whose tiles
      need not meet at a tile boundary.
    block: (rows, cols) of the tile one scale covers.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self) -> None:
        *lead, all_rows, cols = self.data.shape
        parts = self.scale_inv.shape[-3] if self.scale_inv.dim() >= 3 else 0
        if self.data.dtype != FP8_DTYPE or self.scale_inv.dtype != SCALE_DTYPE:
            raise ValueError(
                f"need {FP8_DTYPE} data and float32 scales, got {self.data.dtype} and {self.scale_inv.dtype}"
            )
        if not parts or all_rows % parts:
            raise ValueError(f"scales {tuple(self.scale_inv.shape)} have no part grid dividing {all_rows} rows")
        want = (*lead, parts, *scale_shape((all_rows // parts, cols), self.block))
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(
                f"scales {tuple(self.scale_inv.shape)} do not cover data {tuple(self.data.shape)} in "
                f"{self.block[0]}x{self.block[1]} tiles ({parts} parts): expected {want}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def rows_per_part(self) -> int:
        """Rows of one part: output feature n is row `n % rows_per_part` of part `n // rows_per_part`."""
        return self.data.shape[-2] // self.scale_inv.shape[-3]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's values in `dtype` (what the torch path computes with)."""
        return dequantize(self.data, self.scale_inv, self.block, dtype)
