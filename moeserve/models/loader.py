"""Fill a `MoECausalLM` from a Hugging Face checkpoint, reading only what this rank holds.

Each of our parameters maps to one or more checkpoint tensors (`WeightSource`): gate and up
projections are concatenated into one GEMM, and an MoE layer's experts are stacked into one
tensor, of only the experts this rank's physical slots hold (`ExpertMap.local_logical`: a
logical expert with replicas is read by each rank holding one). Every source is checked for
presence and shape before any tensor is read, so a bad checkpoint fails with one message and
leaves nothing half-loaded.

FP8 checkpoints (`models/fp8.py`): the parameters whose checkpoint tensors are float8_e4m3fn
are replaced by FP8 storage and their scales, read as stored; a tensor-parallel rank reads its
slice of both, which must cut the weight at scale-block boundaries. MXFP4 checkpoints
(gpt-oss, `models/mxfp4.py`): the expert projections are replaced by packed FP4 codes and their
scales, of this rank's experts only.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

from moeserve.config import BlockFP8Config, ModelConfig, MXFP4Config
from moeserve.dispatch import Dispatcher, ExpertMap, ExpertPlacement, create_dispatcher
from moeserve.fp8_format import FP8_DTYPE, scale_name, scale_shape
from moeserve.models.architectures import CheckpointNames, resolve_architecture
from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.decoder import MoECausalLM
from moeserve.models.fp8 import BlockFP8, quantize_parameter
from moeserve.models.mxfp4 import MXFP4, MXFP4ExpertsSource, pack_parameter
from moeserve.models.tensor_parallel import SINGLE, Shard, TensorParallel, shard_of
from moeserve.ops import TORCH_OPS, LayerOps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightSource:
    """parts[i] is concatenated along dim 0; with `stacked`, the parts are then stacked (experts)."""

    parts: tuple[tuple[str, ...], ...]
    stacked: bool = False

    @classmethod
    def one(cls, name: str) -> WeightSource:
        return cls(((name,),))

    @property
    def names(self) -> list[str]:
        return [n for part in self.parts for n in part]


FusedLayout = Literal["gate_up", "gate_up_bias", "down", "down_bias"]


@dataclass(frozen=True)
class FusedExpertsSource:
    """Rows `experts` of one checkpoint tensor stacking all `num_experts` experts of a layer
    (gpt-oss), each turned into our layout:

    gate_up      `[E, H, 2I]`, gate and up columns interleaved -> w13 `[2I, H]`, gate rows then up rows
    gate_up_bias `[E, 2I]`, interleaved alike                   -> b13 `[2I]`
    down         `[E, I, H]`                                     -> w2 `[H, I]`
    down_bias    `[E, H]`                                        -> b2 `[H]`
    """

    name: str
    experts: tuple[int, ...]
    num_experts: int
    layout: FusedLayout

    @property
    def names(self) -> list[str]:
        return [self.name]

    def expected_shape(self, target: torch.Size) -> tuple[int, ...]:
        """The checkpoint tensor's shape for our stacked parameter of shape `target`."""
        per_expert = tuple(target[1:])
        if self.layout in ("gate_up", "down"):
            per_expert = per_expert[::-1]
        return (self.num_experts, *per_expert)

    def read(self, reader: CheckpointReader, dtype: torch.dtype) -> torch.Tensor:
        return torch.stack([self._ours(reader.get_part(self.name, 0, e, 1)[0].to(dtype)) for e in self.experts])

    def _ours(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout in ("gate_up", "down"):
            t = t.t()
        if self.layout in ("gate_up", "gate_up_bias"):
            t = torch.cat((t[0::2], t[1::2]))
        return t.contiguous()


_FUSED = {
    "mlp.experts.w13": ("gate_up_proj", "gate_up"),
    "mlp.experts.b13": ("gate_up_proj_bias", "gate_up_bias"),
    "mlp.experts.w2": ("down_proj", "down"),
    "mlp.experts.b2": ("down_proj_bias", "down_bias"),
}

# Our names for the layer tensors common to every architecture -> checkpoint suffixes.
_COMMON = {
    "input_norm.weight": "input_layernorm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_proj.bias": "self_attn.kv_a_proj_with_mqa.bias",
}


def layer_source(
    layer: int, suffix: str, names: CheckpointNames, local_experts: tuple[int, ...], num_experts: int
) -> WeightSource | FusedExpertsSource:
    """Checkpoint tensors behind `layers.{layer}.{suffix}` of our model; local_experts: the
    checkpoint expert in each of this rank's slots of that layer (unused if it has no experts),
    of the model's `num_experts`."""
    p = f"model.layers.{layer}."
    moe = f"{p}{names.moe}."
    if names.fused_experts and suffix in _FUSED:
        tensor, layout = _FUSED[suffix]
        return FusedExpertsSource(f"{moe}experts.{tensor}", local_experts, num_experts, layout)
    if suffix in _COMMON:
        return WeightSource.one(p + _COMMON[suffix])
    if suffix.startswith("attn."):
        return WeightSource.one(p + "self_attn." + suffix[len("attn.") :])
    if suffix == "mlp.gate_up":
        return WeightSource(((f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"),))
    if suffix == "mlp.down":
        return WeightSource.one(f"{p}mlp.down_proj.weight")
    if suffix == "mlp.router.weight":
        return WeightSource.one(f"{moe}{names.router}.weight")
    if suffix == "mlp.router.bias":
        return WeightSource.one(f"{moe}{names.router}.bias")
    if suffix == "mlp.router.correction_bias":
        return WeightSource.one(f"{moe}{names.correction_bias}")
    if suffix == "mlp.experts.w13":
        experts = [f"{moe}experts.{e}." for e in local_experts]
        return WeightSource(
            tuple((f"{e}{names.expert_gate}.weight", f"{e}{names.expert_up}.weight") for e in experts), stacked=True
        )
    if suffix == "mlp.experts.w2":
        return WeightSource(
            tuple((f"{moe}experts.{e}.{names.expert_down}.weight",) for e in local_experts), stacked=True
        )
    if suffix == "mlp.shared.gate_up":
        s = f"{moe}{names.shared_expert}."
        return WeightSource(((f"{s}gate_proj.weight", f"{s}up_proj.weight"),))
    if suffix == "mlp.shared.down":
        return WeightSource.one(f"{moe}{names.shared_expert}.down_proj.weight")
    if suffix == "mlp.shared_gate":
        return WeightSource.one(f"{moe}{names.shared_expert_gate}.weight")
    raise KeyError(f"no checkpoint mapping for layer parameter {suffix!r}")


def weight_source(
    name: str, names: CheckpointNames, experts_by_layer: dict[int, tuple[int, ...]], num_experts: int
) -> WeightSource | FusedExpertsSource:
    """experts_by_layer: decoder layer -> the checkpoint expert in each of this rank's slots."""
    if name == "embed_tokens":
        return WeightSource.one("model.embed_tokens.weight")
    if name == "lm_head":
        return WeightSource.one("lm_head.weight")
    if name == "norm.weight":
        return WeightSource.one("model.norm.weight")
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"no checkpoint mapping for parameter {name!r}")
    layer = int(match.group(1))
    return layer_source(layer, match.group(2), names, experts_by_layer.get(layer, ()), num_experts)


def _expected_part_shape(source: WeightSource, target: torch.Size) -> tuple[int, ...]:
    """Shape the first tensor of each part must have (parts split target's dim 0 evenly)."""
    per_part = target[1:] if source.stacked else target
    return (per_part[0] // len(source.parts[0]), *per_part[1:])


def _checkpoint_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor a (possibly tensor-parallel sharded) parameter comes from."""
    shard = shard_of(param)
    return param.shape if shard is None else torch.Size(shard.full_shape(param.shape))


def check_sources(
    sources: dict[str, WeightSource | FusedExpertsSource], targets: dict[str, torch.Tensor], reader: CheckpointReader
) -> None:
    """Every tensor present with the shape our parameter expects; otherwise one clear error."""
    missing = [n for s in sources.values() for n in s.names if n not in reader]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {reader.folder} is missing tensors: {', '.join(missing[:5])}{more}")
    for name, source in sources.items():
        if isinstance(source, FusedExpertsSource):
            want = source.expected_shape(targets[name].shape)
        else:
            want = _expected_part_shape(source, _checkpoint_shape(targets[name]))
        for tensor_name in source.names:
            got = reader.shape(tensor_name)
            if got != want:
                raise CheckpointError(
                    f"tensor {tensor_name} has shape {list(got)}, expected {list(want)} from config.json"
                )


def read_source(
    source: WeightSource | FusedExpertsSource, reader: CheckpointReader, dtype: torch.dtype, shard: Shard | None = None
) -> torch.Tensor:
    """The parameter's value; a sharded one (always a single checkpoint tensor) reads only its part."""
    if isinstance(source, FusedExpertsSource):
        return source.read(reader, dtype)
    if shard is not None:
        (name,) = source.names
        part = reader.get_part(name, shard.dim, shard.start, shard.length).to(dtype)
        return torch.zeros_like(part) if shard.zeros else part
    parts = [torch.cat([reader.get(n).to(dtype) for n in part], dim=0) for part in source.parts]
    return torch.stack(parts) if source.stacked else parts[0]


_FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn


def fp8_sources(
    sources: dict[str, WeightSource | FusedExpertsSource], reader: CheckpointReader, quant: BlockFP8Config | None
) -> dict[str, WeightSource]:
    """Our parameters whose checkpoint tensors are FP8, each checked to have its scales in the
    published layout (float32, one per block, partial blocks included)."""
    found: dict[str, WeightSource] = {}
    for name, source in sources.items():
        fp8 = [reader.dtype(n) == _FP8 for n in source.names]
        if not any(fp8):
            continue
        if quant is None:
            raise CheckpointError(f"tensor {source.names[0]} is FP8 but config.json has no quantization_config")
        if isinstance(source, FusedExpertsSource):
            raise CheckpointError(f"tensor {source.name} is FP8: FP8 stacked expert tensors are not supported")
        if not all(fp8):
            raise CheckpointError(f"tensors {', '.join(source.names)} mix FP8 and unquantized weights in one parameter")
        found[name] = source
    if quant is not None and not found:
        raise CheckpointError(
            f"config.json says quant_method 'fp8' but no weight tensor of {reader.folder} is float8_e4m3fn"
        )
    for source in found.values():
        for tensor in source.names:
            scales, want = scale_name(tensor), scale_shape(reader.shape(tensor), quant.block)
            if scales not in reader:
                raise CheckpointError(f"FP8 tensor {tensor} has no {scales} in the checkpoint")
            if reader.shape(scales) != want or reader.dtype(scales) != "F32":
                raise CheckpointError(
                    f"tensor {scales} is {reader.dtype(scales)} {list(reader.shape(scales))}, "
                    f"expected F32 {list(want)}: "
                    f"one scale per {quant.block[0]}x{quant.block[1]} block of {tensor} {list(reader.shape(tensor))}"
                )
    return found


def mxfp4_sources(
    sources: dict[str, WeightSource | FusedExpertsSource],
    targets: dict[str, torch.Tensor],
    reader: CheckpointReader,
    quant: BlockFP8Config | MXFP4Config | None,
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
    source: WeightSource, reader: CheckpointReader, block: tuple[int, int], shard: Shard | None
) -> torch.Tensor:
    """The scales of an FP8 parameter in `fp8.BlockFP8`'s layout: one grid per part."""
    if shard is not None:
        (name,) = source.names
        rows = scale_shard(shard, block, name)
        return reader.get_part(scale_name(name), rows.dim, rows.start, rows.length)[None]
    parts = [torch.stack([reader.get(scale_name(n)) for n in part]) for part in source.parts]
    return torch.stack(parts) if source.stacked else parts[0]


def read_held(
    source: WeightSource | FusedExpertsSource | MXFP4ExpertsSource,
    reader: CheckpointReader,
    dtype: torch.dtype,
    fp8_block: tuple[int, int] | None,
    shard: Shard | None = None,
) -> tuple[torch.Tensor, ...]:
    """A parameter's tensors exactly as the model holds them: its value in `dtype`, or, quantized,
    its stored bytes and scales (an MXFP4 source; an FP8 one when `fp8_block` is given). The one
    place a checkpoint tensor takes its in-memory layout, for a load and for a heal alike."""
    if isinstance(source, MXFP4ExpertsSource):
        return source.read(reader)
    if fp8_block is not None:
        return read_source(source, reader, FP8_DTYPE, shard), read_scales(source, reader, fp8_block, shard)
    return (read_source(source, reader, dtype, shard),)


def _scale_grid(
    source: WeightSource, reader: CheckpointReader, block: tuple[int, int], shard: Shard | None
) -> tuple[int, ...]:
    """The scale grid of one part of the parameter this rank holds."""
    if shard is None:
        return scale_shape(reader.shape(source.names[0]), block)
    full = list(scale_shape(reader.shape(source.names[0]), block))
    full[shard.dim] = scale_shard(shard, block, source.names[0]).length
    return tuple(full)


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dispatcher: Dispatcher | None = None,
    tp: TensorParallel = SINGLE,
    ops: LayerOps = TORCH_OPS,
    expert_map: ExpertMap | None = None,
) -> MoECausalLM:
    """Build the model for `folder`'s architecture and load this rank's share of its weights.

    The rank's physical expert slots are `dispatcher.placement`'s, and `expert_map` says which
    logical expert each holds (None: slot e holds expert e, no redundant experts); without a
    dispatcher the model holds every slot and uses the `local` backend. Under tensor parallelism the attention
    layers declare which part of each tensor this rank holds (`tensor_parallel.Shard`).
    """
    reader = CheckpointReader(folder)
    arch, cfg = resolve_architecture(reader.config)
    if dispatcher is None:
        dispatcher = create_dispatcher("local", ExpertPlacement.contiguous(cfg.num_experts), device)
    placement = dispatcher.placement
    moe_layers = cfg.moe_layer_indices
    if expert_map is None:
        expert_map = ExpertMap.default(cfg.num_experts, 0, placement.ep_size, len(moe_layers))
    expert_map.check_model(cfg.num_experts, len(moe_layers), placement.ep_size)
    if placement.num_experts != expert_map.num_physical:
        raise ValueError(
            f"placement covers {placement.num_experts} expert slots, the expert map {expert_map.num_physical}"
        )
    reason = ops.supports_model(cfg)
    if reason is not None:
        raise ValueError(f"{cfg.architecture} cannot run on kernels={ops.name}: {reason}")
    model = MoECausalLM(cfg, dispatcher, dtype, device, tp, ops)
    experts_by_layer = {layer: expert_map.local_logical(i, placement.rank) for i, layer in enumerate(moe_layers)}
    targets = {name: p for name, p in model.named_parameters()}
    sources = {name: weight_source(name, arch.names, experts_by_layer, cfg.num_experts) for name in targets}
    mxfp4 = mxfp4_sources(sources, targets, reader, cfg.weight_quant)
    plain = {name: source for name, source in sources.items() if name not in mxfp4}
    check_sources(plain, targets, reader)
    fp8_quant = cfg.weight_quant if isinstance(cfg.weight_quant, BlockFP8Config) else None
    fp8 = fp8_sources(plain, reader, fp8_quant)
    block = fp8_quant.block if fp8_quant is not None else (0, 0)
    storage = {}
    for name in mxfp4:
        module, attr = name.rsplit(".", 1)
        storage[name] = pack_parameter(model.get_submodule(module), attr)
    for name, source in fp8.items():
        module, attr = name.rsplit(".", 1)
        grid = _scale_grid(source, reader, block, shard_of(targets[name]))
        storage[name] = quantize_parameter(model.get_submodule(module), attr, len(source.parts[0]), block, grid)
    with torch.no_grad():
        for name, param in targets.items():
            source = mxfp4.get(name) or fp8.get(name) or sources[name]
            fp8_block = block if name in fp8 else None
            # Router correction bias and fp32 gates keep their own dtype (see Router).
            held = read_held(source, reader, param.dtype, fp8_block, shard_of(param))
            for stored, value in zip(storage.get(name, (param,)), held, strict=True):
                stored.copy_(value)
    reader.close()
    model.set_expert_map(expert_map, placement.rank)
    sizes = weight_bytes(model)
    logger.info(
        "loaded %s from %s: %d layers, %d/%d experts on this rank (%.1f MiB), %.1f MiB of other weights (%s%s)",
        cfg.architecture,
        folder,
        cfg.num_layers,
        placement.num_local_experts,
        cfg.num_experts,
        sizes.experts / 2**20,
        sizes.other / 2**20,
        dtype,
        f", {len(fp8)} parameters in FP8" if fp8 else f", {len(mxfp4)} parameters in MXFP4" if mxfp4 else "",
    )
    return model


class ExpertReader:
    """Logical experts' weights read from the checkpoint and stacked as an MoE layer holds them:
    what a survivor of lost ranks loads for experts no surviving rank holds (`eplb.recovery`).
    A quantized parameter gives its stored bytes and its scales, as `load_model` holds them for a
    rank whose slots hold those experts (`read_held`)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype) -> None:
        self._reader = CheckpointReader(folder)
        arch, self._cfg = resolve_architecture(self._reader.config)
        self._names, self._dtype = arch.names, dtype

    def read(self, moe_layer: int, module: nn.Module, experts: list[int]) -> dict[str, torch.Tensor]:
        """Every parameter of MoE layer `moe_layer`'s experts `module` (in model order), by its
        name in `module.named_parameters()` (`parametrizations.w13.original` and
        `parametrizations.w13.0.scale_inv` for FP8 storage and scales), stacked over `experts`."""
        layer = self._cfg.moe_layer_indices[moe_layer]
        read: dict[str, torch.Tensor] = {}
        for param in _held_parameters(module):
            source = layer_source(layer, f"mlp.experts.{param}", self._names, tuple(experts), self._cfg.num_experts)
            names, fp8_block = [param], None
            if parametrize.is_parametrized(module, param):
                param_list = module.parametrizations[param]
                names = [f"parametrizations.{param}.{n}" for n, _ in param_list.named_parameters()]
                quant = param_list[0]
                if isinstance(quant, MXFP4):
                    source = MXFP4ExpertsSource(source.name, source.experts, source.num_experts, source.layout)
                elif isinstance(quant, BlockFP8):
                    fp8_block = quant.block
                else:
                    raise TypeError(f"experts.{param} is under an unknown parametrization {type(quant).__name__}")
            elif any(self._reader.dtype(name) == _FP8 for name in source.names):
                raise CheckpointError(f"{source.names[0]} is FP8 but the model holds experts.{param} unquantized")
            read.update(zip(names, read_held(source, self._reader, self._dtype, fp8_block), strict=True))
        return read

    def close(self) -> None:
        self._reader.close()


def _held_parameters(module: nn.Module) -> list[str]:
    """`module`'s own parameter names, a parametrized one by the name it is read by, in the order
    `named_parameters()` gives their tensors."""
    names = []
    for name, _ in module.named_parameters():
        if name.startswith("parametrizations."):
            name = name.split(".")[1]
        if name not in names:
            names.append(name)
    return names


@dataclass(frozen=True)
class WeightBytes:
    experts: int  # routed experts this rank holds
    other: int  # everything else: attention (this rank's TP share), dense layers, shared experts, embeddings


def weight_bytes(model: MoECausalLM) -> WeightBytes:
    experts = other = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if ".experts." in name:
            experts += size
        else:
            other += size
    return WeightBytes(experts, other)


def model_config(folder: str | Path) -> ModelConfig:
    """The normalised config of a checkpoint, without reading any weight."""
    return resolve_architecture(CheckpointReader(folder).config)[1]
