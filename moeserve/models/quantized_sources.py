"""Quantized checkpoint tensors: which of our parameters are stored FP8, MXFP4, INT4 or NVFP4,
checked, and how their bytes and scales are read as the model holds them.

FP8 (`models/fp8.py`): block-scaled float8_e4m3fn weights with one scale per block, stored in
float32, bfloat16 or float16 as each release chose and widened (exactly) to float32 as read; a
tensor-parallel rank reads its slice of both, which must cut the weight at scale-block
boundaries; Qwen3.5's stacked experts stay FP8 too, and the Gated DeltaNet projections, read by
rows that need not fall on blocks, are dequantized at load (`FP8RowsSource`). MXFP4 (gpt-oss,
`models/mxfp4.py`): the expert projections as packed FP4 codes and their scales, of a rank's
experts only; those scales are uint8 power-of-two exponents, kept as
stored. INT4 and NVFP4 (`models/packed.py`): which linear layers are quantized is what the
config's rules say of each one's checkpoint name; the routed experts are read packed, of a rank's
experts only; any other linear layer the rules quantize is dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.config import BlockFP8Config, MXFP4Config, NVFP4Config, PackedInt4Config, WeightQuant
from moeserve.fp8_format import (
    FP8_DTYPE,
    SCALE_DTYPE,
    dequantize,
    is_power_of_two,
    released_v4_scale_name,
    scale_name,
    scale_shape,
)
from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.int4 import Int4Format
from moeserve.models.mxfp4 import MXFP4ExpertsSource, V4FP4Format
from moeserve.models.nvfp4 import NVFP4Format
from moeserve.models.packed import DequantizedSource, PackedExpertsSource, PerModuleFormat
from moeserve.models.tensor_parallel import Shard
from moeserve.models.weight_sources import FusedExpertsSource, RowsSource, WeightSource, read_source

FP8_TENSOR = "F8_E4M3"
"""safetensors' name of float8_e4m3fn."""
FP8_SCALE_TENSORS = ("F32", "BF16", "F16")
"""safetensors' names of the dtypes FP8 releases store their scales in (DeepSeek-V3: float32;
Qwen3-FP8: bfloat16 or float16); each widens exactly to float32."""
UE8M0_SCALE_TENSORS = (*FP8_SCALE_TENSORS, "F8_E8M0")
"""Under `scale_fmt: ue8m0`, e8m0 exponent bytes too (DeepSeek-V4's FP4-expert releases)."""


def fp8_scale_name(reader: CheckpointReader, weight: str) -> str:
    """The checkpoint's name of FP8 `weight`'s scales: `<weight>_scale_inv` (DeepSeek-V3, Qwen3,
    transformers), or DeepSeek-V4's released `<module>.scale` where the checkpoint has that one."""
    released = released_v4_scale_name(weight)
    return released if scale_name(weight) not in reader and released in reader else scale_name(weight)


def _check_ue8m0(reader: CheckpointReader, tensor: str) -> None:
    """`scale_fmt: ue8m0` promises powers of two: a scale that is not one (a float32 scale of
    another value, or the e8m0 NaN byte) is refused by the tensor's name and its first bad entry."""
    scales = reader.get(tensor).float()
    bad = ~is_power_of_two(scales)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise CheckpointError(
            f"tensor {tensor} holds {scales[where].item()} at {list(where)}: quantization_config scale_fmt "
            f"'ue8m0' says every FP8 scale is a power of two"
        )


def fp8_sources(
    sources: dict[str, WeightSource | FusedExpertsSource | RowsSource],
    reader: CheckpointReader,
    quant: BlockFP8Config | None,
) -> tuple[dict[str, WeightSource | FusedExpertsSource], dict[str, FP8RowsSource]]:
    """Our parameters whose checkpoint tensors are FP8, each checked to have its scales in the
    published layout (float32, bfloat16 or float16, one per block, partial blocks included):
    those kept FP8 (linear layers, experts per expert or stacked as Qwen3.5 releases them), and
    the Gated DeltaNet projections, dequantized at load (`FP8RowsSource`)."""
    kept: dict[str, WeightSource | FusedExpertsSource] = {}
    dequantized: dict[str, FP8RowsSource] = {}
    for name, source in sources.items():
        fp8 = [reader.dtype(n) == FP8_TENSOR for n in source.names]
        if not any(fp8):
            continue
        tensor = source.names[fp8.index(True)]
        if quant is None:
            raise CheckpointError(f"tensor {tensor} is FP8 but config.json has no quantization_config")
        for listed in (n for n, q in zip(source.names, fp8) if q and not quant.converts(n.removesuffix(".weight"))):
            raise CheckpointError(
                f"tensor {listed} is FP8 but quantization_config.modules_to_not_convert lists its module"
            )
        if isinstance(source, FusedExpertsSource) and source.layout != "rows":
            raise CheckpointError(
                f"tensor {source.name} is FP8: stacked expert tensors are read in FP8 as Qwen3.5 releases them "
                "(`[experts, out, in]`), not in gpt-oss's layout"
            )
        if isinstance(source, RowsSource) and (len(reader.shape(tensor)) != 2 or not tensor.endswith(".weight")):
            raise CheckpointError(
                f"tensor {tensor} is FP8: of a Gated DeltaNet only the projections are read in FP8 "
                "(the releases keep conv1d, A_log and dt_bias unquantized)"
            )
        if not all(fp8):
            raise CheckpointError(f"tensors {', '.join(source.names)} mix FP8 and unquantized weights in one parameter")
        if isinstance(source, RowsSource):
            dequantized[name] = FP8RowsSource(source, quant.block)
        else:
            kept[name] = source
    if quant is not None and not kept and not dequantized:
        raise CheckpointError(
            f"config.json says quant_method 'fp8' but no weight tensor of {reader.folder} is float8_e4m3fn"
        )
    dtypes = UE8M0_SCALE_TENSORS if quant is not None and quant.ue8m0 else FP8_SCALE_TENSORS
    for source in [*kept.values(), *(d.rows for d in dequantized.values())]:
        for tensor in source.names:
            scales, want = fp8_scale_name(reader, tensor), _stored_scales(source, reader, tensor, quant.block)
            if scales not in reader:
                raise CheckpointError(f"FP8 tensor {tensor} has no {scales} in the checkpoint")
            if reader.shape(scales) != want or reader.dtype(scales) not in dtypes:
                raise CheckpointError(
                    f"tensor {scales} is {reader.dtype(scales)} {list(reader.shape(scales))}, "
                    f"expected {', '.join(dtypes[:-1])} or {dtypes[-1]} {list(want)}: "
                    f"one scale per {quant.block[0]}x{quant.block[1]} block of {tensor} {list(reader.shape(tensor))}"
                    + (f", {fp8_parts(source)} parts per expert" if isinstance(source, FusedExpertsSource) else "")
                )
            if quant.ue8m0:
                _check_ue8m0(reader, scales)
    return kept, dequantized


def fp8_parts(source: WeightSource | FusedExpertsSource) -> int:
    """The checkpoint projections one FP8 parameter's rows concatenate, each with its own scale
    grid: gate and up of a fused gate_up (Qwen3.5's stacked `gate_up_proj` included: its
    releases scale each half as the per-expert tensors it stacks), else one."""
    if isinstance(source, FusedExpertsSource):
        return 2 if source.name.endswith("gate_up_proj") else 1
    return len(source.parts[0])


def _stored_scales(
    source: WeightSource | FusedExpertsSource | RowsSource,
    reader: CheckpointReader,
    tensor: str,
    block: tuple[int, int],
) -> tuple[int, ...]:
    """The shape of FP8 `tensor`'s stored scales: a stacked expert tensor's part grids stacked
    along its rows, per expert."""
    if not isinstance(source, FusedExpertsSource):
        return scale_shape(reader.shape(tensor), block)
    grid_rows, grid_cols = scale_grid(source, reader, block, None)
    return (reader.shape(tensor)[0], fp8_parts(source) * grid_rows, grid_cols)


@dataclass(frozen=True)
class FP8RowsSource:
    """A Gated DeltaNet projection stored FP8 (`in_proj_qkvz`, Qwen3.5's `in_proj_qkv` and
    `in_proj_z`), dequantized at load into the compute dtype and then cut to our rows. Kept FP8,
    its rows would not fall on scale blocks: Qwen3-Next interleaves q, k, v and z per key head,
    and a tensor-parallel rank holds its heads' rows of each. These projections are a few percent
    of a release's bytes; `out_proj`, cut by columns as o_proj is, stays FP8."""

    rows: RowsSource
    block: tuple[int, int]

    @property
    def names(self) -> list[str]:
        return [self.rows.name, scale_name(self.rows.name)]

    def read(self, reader: CheckpointReader, dtype: torch.dtype) -> torch.Tensor:
        scales = reader.get(scale_name(self.rows.name)).to(SCALE_DTYPE)[None]
        values = dequantize(reader.get(self.rows.name), scales, self.block, dtype)
        return values[torch.tensor(self.rows.rows, dtype=torch.int64)]


def mxfp4_sources(
    sources: dict[str, WeightSource | FusedExpertsSource],
    targets: dict[str, torch.Tensor],
    reader: CheckpointReader,
    quant: WeightQuant | None,
) -> dict[str, MXFP4ExpertsSource]:
    """Our expert projections held as MXFP4 in the checkpoint (none unless config.json says
    mxfp4), each checked; any other `*_blocks`/`*_scales` tensor is refused by name, since only
    gpt-oss's expert projections exist in the format."""
    if not isinstance(quant, MXFP4Config):
        return {}
    found = {
        name: MXFP4ExpertsSource(source.name, source.experts, source.num_experts, source.layout)
        for name, source in sources.items()
        if isinstance(source, FusedExpertsSource)
        and source.layout in ("gate_up", "down")
        and f"{source.name}_blocks" in reader
    }
    if not found:
        raise CheckpointError(
            f"config.json says quant_method 'mxfp4' but {reader.folder} has no mlp.experts.*_blocks tensor"
        )
    for name, source in found.items():
        source.check(reader, targets[name].shape)
    read = {tensor for source in found.values() for tensor in source.names}
    stray = sorted(n for n in reader.weight_map if n.endswith(("_blocks", "_scales")) and n not in read)
    if stray:
        raise CheckpointError(
            f"tensor {stray[0]} looks MXFP4: only gpt-oss's expert projections "
            "(mlp.experts.gate_up_proj, mlp.experts.down_proj) are read in that format"
        )
    return found


def fp4_expert_sources(sources: dict[str, WeightSource | FusedExpertsSource]) -> dict[str, PackedExpertsSource]:
    """DeepSeek-V4's FP4 routed experts (`expert_dtype: fp4`): every stacked expert parameter,
    read packed per expert and projection (`mxfp4.V4FP4Format`); the rest of the checkpoint
    stays FP8 or unquantized."""
    return {
        name: PackedExpertsSource(
            tuple(tuple(n.removesuffix(".weight") for n in part) for part in source.parts), V4FP4Format()
        )
        for name, source in sources.items()
        if isinstance(source, WeightSource) and source.stacked
    }


@dataclass(frozen=True)
class FP8DequantizedSource:
    """An FP8 parameter whose layer has no FP8 product (it reads its weight rather than handing
    it to the ops backend as stored, as DeepSeek-V4's grouped output projection does): read
    with its scales and dequantized at load, so no step pays for dequantizing it again."""

    source: WeightSource
    block: tuple[int, int]

    @property
    def names(self) -> list[str]:
        return self.source.names

    def read(self, reader: CheckpointReader, dtype: torch.dtype, shard: Shard | None) -> torch.Tensor:
        weight = read_source(self.source, reader, FP8_DTYPE, shard)
        return dequantize(weight, read_scales(self.source, reader, self.block, shard), self.block, dtype)


_NOT_LINEAR = ("embed_tokens", "norm", "router", "shared_gate", "sinks", "bias")
"""Our parameters that are no linear layer's weight (a quantization config's `Linear` never
covers them): embeddings, norms, routers (which vLLM and the releases keep unquantized), the
shared-expert gate, attention sinks and biases."""


def packed_sources(
    quant: PackedInt4Config | NVFP4Config,
    sources: dict[str, WeightSource | FusedExpertsSource],
    reader: CheckpointReader,
) -> tuple[dict[str, PackedExpertsSource], dict[str, DequantizedSource]]:
    """Our parameters the INT4 / NVFP4 config quantizes (checked by the caller once the model's
    shapes are known): the routed expert projections, kept packed, and any other linear layer
    (attention, shared experts, dense MLPs, LM head), dequantized at load. A quantized tensor
    read another way (stacked gpt-oss experts, Gated DeltaNet projections) is refused by name."""
    packed: dict[str, PackedExpertsSource] = {}
    dequantized: dict[str, DequantizedSource] = {}
    for name, source in sources.items():
        if any(word in name for word in _NOT_LINEAR):
            continue
        modules = [tensor.removesuffix(".weight") for tensor in source.names]
        quantized = [m for m in modules if quant.quantizes(m)]
        if not quantized:
            continue
        if len(quantized) != len(modules):
            plain = next(m for m in modules if m not in quantized)
            raise CheckpointError(
                f"quantization_config ({_method(quant)}) quantizes {quantized[0]} but not {plain}: the modules "
                f"of one parameter ({name}) are read quantized all alike"
            )
        if not isinstance(source, WeightSource):
            raise CheckpointError(
                f"module {quantized[0]} is quantized by quantization_config ({_method(quant)}), and only "
                f"per-expert and plain linear layers are read in that format: a checkpoint must keep it "
                f"unquantized (listed in its {'ignore' if isinstance(quant, PackedInt4Config) else 'exclude_modules'})"
            )
        parts = tuple(tuple(n.removesuffix(".weight") for n in part) for part in source.parts)
        if source.stacked:
            packed[name] = PackedExpertsSource(parts, _format(quant, reader, parts))
        else:
            dequantized[name] = DequantizedSource(parts[0], _format(quant, reader, parts))
    if not packed:
        raise CheckpointError(
            f"config.json says {_method(quant)} but its rules quantize no routed expert projection of {reader.folder}"
        )
    return packed, dequantized


def _method(quant: PackedInt4Config | NVFP4Config) -> str:
    return "compressed-tensors pack-quantized" if isinstance(quant, PackedInt4Config) else "modelopt NVFP4"


def _format(
    quant: PackedInt4Config | NVFP4Config, reader: CheckpointReader, parts: tuple[tuple[str, ...], ...]
) -> PerModuleFormat:
    """The backend of a parameter whose experts are `parts` (INT4: its scales' stored dtype)."""
    if isinstance(quant, NVFP4Config):
        return NVFP4Format()
    return Int4Format.of(reader, parts[0][0], quant.group_size)


def scale_shard(shard: Shard, block: tuple[int, int], name: str) -> Shard:
    """The scale rows (or columns) of a tensor-parallel slice of an FP8 weight: whole blocks
    only, since a block's one scale cannot be split between ranks."""
    size = block[shard.dim]
    end = shard.start + shard.length
    if shard.start % size or (shard.length % size and end != shard.full):
        raise CheckpointError(
            f"tensor parallelism gives a rank entries [{shard.start}, {end}) of dim {shard.dim} of FP8 tensor {name} "
            f"({shard.full}), which cuts a {block[0]}x{block[1]} scale block: each rank's share must be a multiple "
            f"of {size}; use a tensor-parallel size that splits it in whole blocks"
        )
    return Shard(shard.dim, shard.start // size, -(-shard.length // size), -(-shard.full // size))


def read_scales(
    source: WeightSource | FusedExpertsSource, reader: CheckpointReader, block: tuple[int, int], shard: Shard | None
) -> torch.Tensor:
    """The scales of an FP8 parameter in `fp8.BlockFP8`'s layout (one grid per part), float32
    whatever float dtype the checkpoint stored them in: a heal's freshly read scales must meet
    the held ones, and the Triton w8a8 GEMM reads float32."""
    if isinstance(source, FusedExpertsSource):
        parts, name = fp8_parts(source), scale_name(source.name)
        grids = [reader.get_part(name, 0, e, 1)[0] for e in source.experts]
        return torch.stack([g.reshape(parts, -1, g.shape[-1]) for g in grids]).to(SCALE_DTYPE)
    if shard is not None:
        (name,) = source.names
        rows = scale_shard(shard, block, name)
        return reader.get_part(fp8_scale_name(reader, name), rows.dim, rows.start, rows.length)[None].to(SCALE_DTYPE)
    parts = [
        torch.stack([reader.get(fp8_scale_name(reader, n)).to(SCALE_DTYPE) for n in part]) for part in source.parts
    ]
    return torch.stack(parts) if source.stacked else parts[0]


def read_held(
    source: WeightSource
    | FusedExpertsSource
    | MXFP4ExpertsSource
    | PackedExpertsSource
    | DequantizedSource
    | FP8RowsSource
    | FP8DequantizedSource,
    reader: CheckpointReader,
    dtype: torch.dtype,
    fp8_block: tuple[int, int] | None,
    shard: Shard | None = None,
) -> tuple[torch.Tensor, ...]:
    """A parameter's tensors exactly as the model holds them: its value in `dtype`, or, quantized,
    its stored bytes and scales (an MXFP4 or packed source; an FP8 one when `fp8_block` is given). The one
    place a checkpoint tensor takes its in-memory layout, for a load and for a heal alike."""
    if isinstance(source, MXFP4ExpertsSource | PackedExpertsSource):
        return source.read(reader)
    if isinstance(source, DequantizedSource | FP8DequantizedSource):
        return (source.read(reader, dtype, shard),)
    if isinstance(source, FP8RowsSource):
        return (source.read(reader, dtype),)
    if fp8_block is not None:
        return read_source(source, reader, FP8_DTYPE, shard), read_scales(source, reader, fp8_block, shard)
    return (read_source(source, reader, dtype, shard),)


def scale_grid(
    source: WeightSource | FusedExpertsSource, reader: CheckpointReader, block: tuple[int, int], shard: Shard | None
) -> tuple[int, ...]:
    """The scale grid of one part of the parameter this rank holds."""
    if isinstance(source, FusedExpertsSource):
        _, rows, cols = reader.shape(source.name)
        return scale_shape((rows // fp8_parts(source), cols), block)
    if shard is None:
        return scale_shape(reader.shape(source.names[0]), block)
    full = list(scale_shape(reader.shape(source.names[0]), block))
    full[shard.dim] = scale_shard(shard, block, source.names[0]).length
    return tuple(full)
