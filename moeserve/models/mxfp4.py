"""gpt-oss's MXFP4 experts as a `PackedFormat` backend (`models/packed.py`), and read from the
published checkpoint.

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
from moeserve.models.packed import PackedFormat, Storage
from moeserve.mxfp4_format import VALUES_PER_BLOCK, blocks_shape, dequantize, scales_shape


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
