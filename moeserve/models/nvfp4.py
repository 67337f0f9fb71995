"""ModelOpt NVFP4 experts (`nvfp4_format.py`) as a `PackedFormat` backend (per module).

Held: the e2m1 codes `[E, rows, cols / 2]`, the FP8 block scales `[E, rows, cols / 16]` as
stored, and the float32 global scales `[E, parts]`: gate and up are separate checkpoint tensors,
each with its own `weight_scale_2`, so our fused w13 keeps one per part. `input_scale` (the
activations' scale of an FP4 x FP4 GEMM) is checked, not held: activations stay in the compute
dtype, and the weights are dequantized where the arch has no FP4 units.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.packed import PerModuleFormat, Storage, expect, read_scales
from moeserve.nvfp4_format import GROUP, SCALE_DTYPE, codes_shape, dequantize, scale_shape

SCALAR_SHAPES = ((), (1,))  # ModelOpt writes its per-tensor scales as 0-d tensors


@dataclass(frozen=True)
class NVFP4Format(PerModuleFormat):
    name = "NVFP4 (ModelOpt)"
    held = ("scales", "global_scales")
    suffixes = ("weight", "weight_scale", "weight_scale_2")

    def storage(self, shape: tuple[int, ...], parts: int) -> Storage:
        experts = shape[0]
        return (
            (codes_shape(shape), torch.uint8),
            (scale_shape(shape), SCALE_DTYPE),
            ((experts, parts), torch.float32),
        )

    def check(self, reader: CheckpointReader, module: str, rows: int, cols: int) -> None:
        if cols % GROUP:
            raise CheckpointError(
                f"tensor {module}.weight_scale: NVFP4 blocks of {GROUP} do not divide "
                f"its input width {cols} (config.json)"
            )
        expect(reader, f"{module}.weight", ("U8",), codes_shape((rows, cols)), "NVFP4 codes, two e2m1 per byte")
        scales = f"{module}.weight_scale"
        expect(reader, scales, ("F8_E4M3",), scale_shape((rows, cols)), f"one scale per {GROUP} inputs")
        for scalar in ("weight_scale_2", "input_scale"):
            tensor = f"{module}.{scalar}"
            if scalar == "input_scale" and tensor not in reader:
                continue  # weight-only (W4A16) exports have none
            shape = reader.shape(tensor) if tensor in reader else ()
            expect(reader, tensor, ("F32",), shape if shape in SCALAR_SHAPES else (), "one float32 scale per tensor")

    def read(self, reader: CheckpointReader, modules: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        codes = torch.cat([reader.get(f"{m}.weight") for m in modules])
        scales = torch.cat(read_scales(reader, modules, "weight_scale"))
        global_scales = torch.stack([t.reshape(()) for t in read_scales(reader, modules, "weight_scale_2", True)])
        return codes, scales, global_scales

    def dequantize(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(codes, held[0], held[1], dtype)
