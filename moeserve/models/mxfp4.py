"""gpt-oss's MXFP4 experts as a `PackedFormat` backend (`models/packed.py`), and read from the
published checkpoint; DeepSeek-V4's FP4 experts, the same format stored per expert (`V4FP4Format`).

A layer's `w13` `[E_local, 2I, H]` and `w2` `[E_local, H, I]` are stored as the checkpoint's
bytes, outputs first as ours are: codes `[E_local, rows, cols/32, 16]` and e8m0 scales
`[E_local, rows, cols/32]` (`mxfp4_format.py`), about 0.27x their bf16 bytes, held and read
through the same parametrization as INT4's and NVFP4's (`packed.PackedWeight`); the scales are
uint8 power-of-two exponents, kept as stored. No packed GEMM takes the format yet, so the ops
backend is handed the dequantized values (`packed_experts` is None).

The published gate_up rows interleave gate and up (row 2j is gate j, 2j+1 is up j, as
transformers' `gate_up_proj[..., ::2]` / `[..., 1::2]` split them); our w13 has gate rows then up
rows. Rows are independent under MXFP4 (a block runs along a row), so the loader reorders the
packed rows and their scales without touching a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.packed import PackedFormat, PerModuleFormat, Storage, expect
from moeserve.mxfp4_format import BYTES_PER_BLOCK, VALUES_PER_BLOCK, blocks_shape, dequantize, scales_shape
from moeserve.packed_weight import PackedExperts

E8M0_NAN = 0xFF  # the one e8m0 byte that is no power of two


@dataclass(frozen=True)
class MXFP4Format(PackedFormat):
    name = "MXFP4"
    held = ("scales",)

    def storage(self, shape: tuple[int, ...], parts: int) -> Storage:
        return ((blocks_shape(shape), torch.uint8), (scales_shape(shape), torch.uint8))

    def dequantize(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(codes, held[0], dtype)

    def packed_experts(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...]) -> None:
        return None


Layout = Literal["gate_up", "down"]


@dataclass(frozen=True)
class MXFP4ExpertsSource:
    """Rows `experts` of one layer's published `<name>_blocks` / `<name>_scales`, which stack all
    `num_experts` experts; gate_up rows are de-interleaved into our gate-then-up order."""

    name: str  # e.g. model.layers.0.mlp.experts.gate_up_proj
    experts: tuple[int, ...]
    num_experts: int
    layout: Layout

    @property
    def names(self) -> list[str]:
        return [f"{self.name}_blocks", f"{self.name}_scales"]

    def check(self, reader: CheckpointReader, target: torch.Size) -> None:
        """Both tensors present, uint8, of the shapes our parameter `[E_local, rows, cols]` implies."""
        rows, cols = target[1:]
        if cols % VALUES_PER_BLOCK:
            raise CheckpointError(
                f"{self.name}: MXFP4 blocks of {VALUES_PER_BLOCK} cannot cut an input of {cols} values (config.json)"
            )
        for tensor, shape in zip(self.names, (blocks_shape((rows, cols)), scales_shape((rows, cols)))):
            want = (self.num_experts, *shape)
            if tensor not in reader:
                raise CheckpointError(f"checkpoint {reader.folder} is missing tensor {tensor}")
            if reader.dtype(tensor) != "U8" or reader.shape(tensor) != want:
                raise CheckpointError(
                    f"tensor {tensor} is {reader.dtype(tensor)} {list(reader.shape(tensor))}, "
                    f"expected U8 {list(want)} (MXFP4, from config.json)"
                )

    def read(self, reader: CheckpointReader) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes `[E_local, rows, G, 16]`, scales `[E_local, rows, G]`): only this rank's experts' bytes."""
        return tuple(
            torch.stack([self._ours(reader.get_part(tensor, 0, e, 1)[0]) for e in self.experts])
            for tensor in self.names
        )

    def _ours(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[0::2], t[1::2])) if self.layout == "gate_up" else t


@dataclass(frozen=True)
class V4FP4Format(PerModuleFormat):
    """DeepSeek-V4's FP4 experts (`expert_dtype: fp4`), held as MXFP4 is: the same e2m1 codes,
    two per byte with the first input in the low nibble, and the same e8m0 scale byte per 32
    inputs of a row, stored one module per expert and projection: `<module>.weight` int8
    `[rows, cols / 2]` and `<module>.scale` float8_e8m0fnu `[rows, cols / 32]`. Reading them is a
    reshape and a reinterpretation of the bytes, so the experts stay packed as gpt-oss's do."""

    name = "MXFP4 (DeepSeek-V4 FP4 experts)"
    held = ("scales",)
    suffixes = ("weight", "scale")

    def storage(self, shape: tuple[int, ...], parts: int) -> Storage:
        return MXFP4Format().storage(shape, parts)

    def dequantize(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(codes, held[0], dtype)

    def packed_experts(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...]) -> PackedExperts:
        """The codes as the packed grouped GEMM reads FP4 bytes, `[E, N, K / 2]` (a view)."""
        return PackedExperts(codes.flatten(-2), held[0])

    def check(self, reader: CheckpointReader, module: str, rows: int, cols: int) -> None:
        if cols % VALUES_PER_BLOCK:
            raise CheckpointError(
                f"{module}: FP4 scales cover {VALUES_PER_BLOCK} inputs each and cannot cut {cols} (config.json)"
            )
        what = "FP4 expert, from config.json expert_dtype"
        expect(reader, f"{module}.weight", ("I8", "U8"), (rows, cols // 2), f"{what}: two e2m1 codes per byte")
        expect(reader, f"{module}.scale", ("F8_E8M0", "U8"), (rows, cols // VALUES_PER_BLOCK), f"{what}: e8m0 scales")

    def read(self, reader: CheckpointReader, modules: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = [], []
        for module in modules:
            packed = reader.get(f"{module}.weight").view(torch.uint8)
            codes.append(packed.reshape(packed.shape[0], -1, BYTES_PER_BLOCK))
            scale = reader.get(f"{module}.scale").view(torch.uint8)
            if (scale == E8M0_NAN).any():
                where = [int(i) for i in (scale == E8M0_NAN).nonzero()[0]]
                raise CheckpointError(
                    f"tensor {module}.scale holds the e8m0 NaN byte at {where}: scales must be finite"
                )
            scales.append(scale)
        return torch.cat(codes), torch.cat(scales)
