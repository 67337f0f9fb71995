"""Packed 4-bit experts as a GEMM takes them: the stored codes and scales, not a dequantized copy.

What `models.fp8.stored_weight` hands the ops backend for an INT4 (compressed-tensors), NVFP4
(ModelOpt) or MXFP4 (DeepSeek-V4's FP4 experts) expert parameter, as `BlockFP8Weight` is for
FP8: the torch path dequantizes it at use, the Triton path runs its packed grouped GEMMs on it
(`kernels/packed_moe.py`). Its own module, torch-only, because both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve import int4_format, mxfp4_format, nvfp4_format


@dataclass(frozen=True)
class PackedExperts:
    """Stacked experts `[E, N, K]` as the model holds them (`models/int4.py`, `models/nvfp4.py`,
    `models/mxfp4.py`).

    codes: INT4 int32 `[E, N, K / 8]`; NVFP4 and MXFP4 uint8 `[E, N, K / 2]`, the first input in
      the low nibble.
    scales: INT4 `[E, N, K / group]` (bf16, fp16 or fp32); NVFP4 float8_e4m3fn `[E, N, K / 16]`;
      MXFP4 uint8 e8m0 exponents `[E, N, K / 32]` (the scale `2 ** (byte - 127)`).
    global_scales: NVFP4 float32 `[E, parts]` (output feature n is in part `n // (N / parts)`);
      None for INT4 and MXFP4.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scales: torch.Tensor | None = None

    @property
    def nvfp4(self) -> bool:
        return self.global_scales is not None

    @property
    def mxfp4(self) -> bool:
        return self.global_scales is None and self.scales.dtype == torch.uint8  # e8m0 bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, n, packed_k = self.codes.shape
        return experts, n, packed_k * (2 if self.nvfp4 or self.mxfp4 else int4_format.CODES_PER_WORD)

    @property
    def group(self) -> int:
        return self.shape[2] // self.scales.shape[2]

    def __post_init__(self) -> None:
        experts, n, k = self.shape
        want_codes = torch.uint8 if self.nvfp4 or self.mxfp4 else torch.int32
        if self.codes.dtype != want_codes or self.scales.dim() != 3 or self.scales.shape[:2] != (experts, n):
            raise ValueError(
                f"need {want_codes} codes [E, N, packed K] with scales [E, N, groups]; got {self.codes.dtype} "
                f"{tuple(self.codes.shape)} with {tuple(self.scales.shape)}"
            )
        fixed_group = nvfp4_format.GROUP if self.nvfp4 else mxfp4_format.VALUES_PER_BLOCK if self.mxfp4 else None
        if k % self.scales.shape[2] or self.group != (fixed_group or self.group):
            raise ValueError(f"scales {tuple(self.scales.shape)} do not cut {k} inputs into whole groups")
        if self.nvfp4 and (self.global_scales.shape[0] != experts or n % self.global_scales.shape[1]):
            raise ValueError(f"global scales {tuple(self.global_scales.shape)} for {experts} experts of {n} rows")

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The values `[E, N, K]` in `dtype`: what the kernels multiply, up to their rounding."""
        if self.nvfp4:
            return nvfp4_format.dequantize(self.codes, self.scales, self.global_scales, dtype)
        if self.mxfp4:
            blocks = self.codes.unflatten(-1, (-1, mxfp4_format.BYTES_PER_BLOCK))
            return mxfp4_format.dequantize(blocks, self.scales, dtype)
        return int4_format.dequantize(self.codes, self.scales, dtype)
