"""The MXFP4 expert weights gpt-oss is published in (OCP microscaling FP4, as transformers reads it).

A weight `[..., rows, cols]` (rows = output features, cols = input features) is cut along `cols`
into blocks of 32 values. Each value is an e2m1 FP4 code (sign bit, 2 exponent bits, 1 mantissa
bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two codes per byte, the even column in
the low nibble; each block shares one e8m0 scale byte, the power of two `2 ** (byte - 127)`:

    <name>_blocks  uint8 `[..., rows, cols / 32, 16]`
    <name>_scales  uint8 `[..., rows, cols / 32]`

Its own module because both sides of the format need it and neither may import the other: the
loader's in-memory form (`models/mxfp4.py`) and the tiny-checkpoint writer (`checkpoints/`).
"""

from __future__ import annotations

import torch

VALUES_PER_BLOCK = 32  # values sharing one scale
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2  # two FP4 codes per byte
SCALE_BIAS = 127  # e8m0: the scale byte b means 2 ** (b - 127); 255 (NaN) is never written
E2M1_MAX = 6.0
# The value of each e2m1 code 0..15: codes 8..15 are 0..7 with the sign bit set.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def blocks_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `_blocks` tensor of a weight of `shape` `[..., rows, cols]`."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // VALUES_PER_BLOCK, BYTES_PER_BLOCK)


def scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `_scales` tensor of a weight of `shape` `[..., rows, cols]`."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // VALUES_PER_BLOCK)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[..., n]` (each 0..15, n even) -> bytes `[..., n / 2]`, the even code low."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes `[..., n]` -> uint8 codes `[..., 2n]` (inverse of `pack`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [..., rows, cols]` (cols a multiple of 32) -> (blocks, scales) in the published
    layout. Each block's scale is the smallest power of two that brings its largest magnitude
    within e2m1's 6 (so nothing saturates), and each value rounds to the nearest code."""
    *lead, rows, cols = weight.shape
    if cols % VALUES_PER_BLOCK:
        raise ValueError(f"MXFP4 cuts rows into blocks of {VALUES_PER_BLOCK}; {cols} columns do not divide")
    blocks = weight.float().reshape(*lead, rows, cols // VALUES_PER_BLOCK, VALUES_PER_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = blocks / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    return pack(codes), (exponent + SCALE_BIAS).to(torch.uint8)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`blocks [..., rows, G, 16]` with `scales [..., rows, G]` -> the weight `[..., rows, 32 G]`
    in `dtype` (every value is exact in float32, bf16 and fp16 alike, short of under/overflow)."""
    lut = torch.tensor(E2M1_VALUES, device=blocks.device)
    values = lut[unpack(blocks).long()]  # [..., rows, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - SCALE_BIAS)
    return values.flatten(-2).to(dtype)
