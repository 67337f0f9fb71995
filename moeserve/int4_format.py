"""The INT4 weights compressed-tensors writes as `pack-quantized` (W4A16, symmetric, grouped), as
Moonshot publishes Kimi-K2-Thinking's and Kimi-K2.5's routed experts.

A weight `[rows, cols]` (rows = output features) is cut along `cols` into groups of `group`
values sharing one scale; each value is a signed 4-bit integer q in [-8, 7] and means
`q * scale`. Eight codes fill one int32 word, code i of a row at bits `4 (i % 8)` of word
`i // 8`, each stored as `q + 8` (0..15), as the library's `pack_to_int32` lays them out:

    <module>.weight_packed  int32 `[rows, cols / 8]`
    <module>.weight_scale   bfloat16 (or float16 / float32) `[rows, cols / group]`
    <module>.weight_shape   int `[2]`: the unpacked `[rows, cols]`

Its own module because both sides of the format need it and neither may import the other: the
loader's in-memory form (`models/int4.py`) and the tiny-checkpoint writer (`checkpoints/`).
"""

from __future__ import annotations

import torch

BITS = 4
CODES_PER_WORD = 32 // BITS
OFFSET = 1 << (BITS - 1)  # q + 8 is stored: every code a nibble 0..15
Q_MIN, Q_MAX = -OFFSET, OFFSET - 1
_SHIFTS = torch.arange(CODES_PER_WORD, dtype=torch.int32) * BITS


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `weight_packed` tensor of a weight of `shape` `[..., rows, cols]` (cols a multiple of 8)."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // CODES_PER_WORD)


def scale_shape(shape: tuple[int, ...], group: int) -> tuple[int, ...]:
    """The `weight_scale` tensor of a weight of `shape` `[..., rows, cols]` in groups of `group`."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // group)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes `[..., n]` in [-8, 7] (n a multiple of 8) -> int32 words `[..., n / 8]`."""
    nibbles = (codes.to(torch.int32) + OFFSET).unflatten(-1, (-1, CODES_PER_WORD))
    # Shifted nibbles occupy disjoint bits, so their sum is their bitwise or; the top code's
    # bit 31 wraps to the sign of the int32 word, as the library's words have it.
    return (nibbles << _SHIFTS.to(codes.device)).sum(dim=-1, dtype=torch.int64).to(torch.int32)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 words `[..., n]` -> int8 codes `[..., 8 n]` in [-8, 7] (inverse of `pack`)."""
    nibbles = (packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF
    return (nibbles - OFFSET).to(torch.int8).flatten(-2)


def quantize(
    weight: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight [..., rows, cols]` -> (weight_packed, weight_scale) as compressed-tensors' minmax
    observer makes them: each group's scale is its largest magnitude over 7.5, rounded to
    `scale_dtype` first so that the stored pair means what was quantized."""
    *lead, rows, cols = weight.shape
    if cols % group or group % CODES_PER_WORD:
        raise ValueError(f"INT4 groups of {group} do not cut {cols} columns into whole int32 words")
    groups = weight.float().unflatten(-1, (cols // group, group))
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = (amax / (OFFSET - 0.5)).to(scale_dtype).clamp(min=torch.finfo(scale_dtype).tiny)
    codes = torch.round(groups / scale.float()).clamp(Q_MIN, Q_MAX).to(torch.int8)
    return pack(codes.flatten(-2)), scale[..., 0]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`packed [..., rows, cols / 8]` with `scale [..., rows, G]` -> the weight `[..., rows, cols]`
    in `dtype` (code times its group's scale, computed in float32)."""
    codes = unpack(packed)
    groups = codes.unflatten(-1, (scale.shape[-1], -1)).float() * scale.float()[..., None]
    return groups.flatten(-2).to(dtype)
