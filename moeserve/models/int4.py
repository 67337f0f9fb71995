"""compressed-tensors pack-quantized INT4 experts (`int4_format.py`) as a `PackedFormat` backend (per module).

Held: the int32 words `[E, rows, cols / 8]` and the scales `[E, rows, cols / group]` in the dtype
the checkpoint stored them in (bfloat16 in Kimi's releases: widening them would add a fifth to
the experts' bytes). `weight_shape` is checked against config.json, not held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.int4_format import CODES_PER_WORD, dequantize, packed_shape, scale_shape
from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.packed import PerModuleFormat, Storage, expect, read_scales

SCALE_TENSORS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
SHAPE_TENSORS = ("I64", "I32")


@dataclass(frozen=True)
class Int4Format(PerModuleFormat):
    group: int
    scale_dtype: torch.dtype  # as this parameter's checkpoint tensors store their scales

    name = "INT4 (compressed-tensors pack-quantized)"
    held = ("scales",)
    suffixes = ("weight_packed", "weight_scale", "weight_shape")

    @classmethod
    def of(cls, reader: CheckpointReader, module: str, group: int) -> Int4Format:
        """The format of `module`'s parameter, its scales' dtype as the checkpoint stores them."""
        scales = f"{module}.weight_scale"
        if scales not in reader:
            raise CheckpointError(f"checkpoint {reader.folder} is missing tensor {scales} (the INT4 group scales)")
        if reader.dtype(scales) not in SCALE_TENSORS:
            raise CheckpointError(
                f"tensor {scales} is {reader.dtype(scales)}: INT4 group scales are stored {', '.join(SCALE_TENSORS)}"
            )
        return cls(group, SCALE_TENSORS[reader.dtype(scales)])

    def storage(self, shape: tuple[int, ...], parts: int) -> Storage:
        return ((packed_shape(shape), torch.int32), (scale_shape(shape, self.group), self.scale_dtype))

    def check(self, reader: CheckpointReader, module: str, rows: int, cols: int) -> None:
        if cols % self.group or self.group % CODES_PER_WORD:
            raise CheckpointError(
                f"tensor {module}.weight_packed: quantization_config group_size {self.group} does not divide "
                f"its input width {cols} (config.json) into whole groups"
            )
        if f"{module}.weight_zero_point" in reader:
            raise CheckpointError(f"tensor {module}.weight_zero_point: only symmetric INT4 (no zero points) is read")
        expect(reader, f"{module}.weight_packed", ("I32",), packed_shape((rows, cols)), "INT4 codes, 8 per int32")
        dtype = next(k for k, v in SCALE_TENSORS.items() if v == self.scale_dtype)
        expect(
            reader,
            f"{module}.weight_scale",
            (dtype,),
            scale_shape((rows, cols), self.group),
            f"one scale per {self.group} inputs, in the dtype of the parameter's other scales",
        )
        expect(reader, f"{module}.weight_shape", SHAPE_TENSORS, (2,), "the unpacked [rows, cols]")
        stated = reader.get(f"{module}.weight_shape").tolist()
        if stated != [rows, cols]:
            raise CheckpointError(f"tensor {module}.weight_shape says {stated}, config.json implies {[rows, cols]}")

    def read(self, reader: CheckpointReader, modules: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        codes = torch.cat([reader.get(f"{m}.weight_packed") for m in modules])
        return codes, torch.cat(read_scales(reader, modules, "weight_scale"))

    def dequantize(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(codes, held[0], dtype)
