"""The NVFP4 weights NVIDIA's ModelOpt publishes (DeepSeek-R1/V3-FP4, Qwen3-FP4, ...): e2m1 codes
with an FP8 scale per 16 inputs and a float32 scale per tensor, the format Blackwell's FP4 tensor
cores run.

A weight `[rows, cols]` (rows = output features) is cut along `cols` into blocks of 16; each
value is an e2m1 code (the same 16 values as MXFP4's, `mxfp4_format.E2M1_VALUES`), two per
byte with the even column in the low nibble, and means `code * weight_scale * weight_scale_2`:

    <module>.weight          uint8 `[rows, cols / 2]`
    <module>.weight_scale    float8_e4m3fn `[rows, cols / 16]`
    <module>.weight_scale_2  float32 `[]`: the tensor's global scale
    <module>.input_scale     float32 `[]`: the activations' global scale, for an FP4 x FP4 GEMM
                             (read and checked; activations stay in the compute dtype here)

Its own module because both sides of the format need it and neither may import the other: the
loader's in-memory form (`models/nvfp4.py`) and the tiny-checkpoint writer (`checkpoints/`).
"""

from __future__ import annotations

import torch

from moeserve.mxfp4_format import E2M1_MAX, E2M1_VALUES, pack, unpack

GROUP = 16  # values sharing one FP8 scale
SCALE_DTYPE = torch.float8_e4m3fn
SCALE_MAX = torch.finfo(SCALE_DTYPE).max  # 448
SCALE_MIN = 2.0**-9  # e4m3's smallest subnormal: an all-zero block's scale stays nonzero


def codes_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `weight` (codes) tensor of a weight of `shape` `[..., rows, cols]`."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // 2)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The `weight_scale` tensor of a weight of `shape` `[..., rows, cols]`."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // GROUP)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight [rows, cols]` -> (codes, weight_scale, weight_scale_2) as ModelOpt makes them: the
    global scale maps the tensor's largest magnitude to e2m1's 6 times e4m3's 448, each block's
    FP8 scale maps its own largest magnitude to 6 (rounded to e4m3 first), each value rounds to
    the nearest code."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"NVFP4 cuts rows into blocks of {GROUP}; {cols} columns do not divide")
    w = weight.float()
    global_scale = (w.abs().amax() / (E2M1_MAX * SCALE_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    blocks = w.reshape(rows, cols // GROUP, GROUP)
    block_amax = blocks.abs().amax(dim=-1)
    scale = (block_amax / (E2M1_MAX * global_scale)).clamp(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    scaled = blocks / (scale.float() * global_scale)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    return pack(codes.reshape(rows, cols)), scale, global_scale


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`codes [..., parts * rows, cols / 2]`, `scale [..., parts * rows, cols / 16]` and
    `global_scale [..., parts]` (one per checkpoint tensor concatenated into the rows: gate and
    up have their own) -> the weight `[..., parts * rows, cols]` in `dtype`, computed in float32."""
    lut = torch.tensor(E2M1_VALUES, device=codes.device)
    values = lut[unpack(codes).long()]
    blocks = values.unflatten(-1, (scale.shape[-1], GROUP)) * scale.float()[..., None]
    parts = global_scale.shape[-1]
    by_part = blocks.unflatten(-3, (parts, -1)) * global_scale.float()[..., None, None, None]
    return by_part.flatten(-4, -3).flatten(-2).to(dtype)
