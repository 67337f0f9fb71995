"""Fill a `MoECausalLM` from a Hugging Face checkpoint, reading only what this rank holds.

Each of our parameters maps to checkpoint tensors (`weight_sources`), of only the experts this
rank's physical slots hold (`ExpertMap.local_logical`: a logical expert with replicas is read by
each rank holding one). Every source is checked for presence and shape before any tensor is
read, so a bad checkpoint fails with one message and leaves nothing half-loaded. Parameters
stored FP8 or MXFP4 (`quantized_sources`) are replaced by their stored bytes and scales first.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from moeserve.config import BlockFP8Config, ModelConfig, NVFP4Config, PackedInt4Config
from moeserve.dispatch import Dispatcher, ExpertMap, ExpertPlacement, create_dispatcher
from moeserve.models.architectures import CheckpointNames, resolve_architecture
from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.decoder import MoECausalLM
from moeserve.models.fp8 import BlockFP8, quantize_parameter
from moeserve.models.layers.norm import RMSNorm
from moeserve.models.mxfp4 import MXFP4ExpertsSource, MXFP4Format
from moeserve.models.packed import PackedExpertsSource, PackedWeight, pack_parameter
from moeserve.models.quantized_sources import (
    FP8_TENSOR,
    FP8DequantizedSource,
    fp4_expert_sources,
    fp8_parts,
    fp8_sources,
    mxfp4_sources,
    packed_sources,
    read_held,
    scale_grid,
)
from moeserve.models.tensor_parallel import SINGLE, TensorParallel, shard_of
from moeserve.models.v4.model import DeepseekV4CausalLM
from moeserve.models.v4.weights import layout_of, v4_source
from moeserve.models.weight_sources import check_sources, checkpoint_shape, layer_source, rows_source, weight_source
from moeserve.ops import TORCH_OPS, LayerOps

logger = logging.getLogger(__name__)


def load_model(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    dispatcher: Dispatcher | None = None,
    tp: TensorParallel = SINGLE,
    ops: LayerOps = TORCH_OPS,
    expert_map: ExpertMap | None = None,
    with_mtp: bool = False,
    indexer_key_dtype: str = "auto",
) -> MoECausalLM:
    """Build the model for `folder`'s architecture and load this rank's share of its weights.

    `with_mtp`: also load the checkpoint's multi-token prediction layers (speculative decoding's
    mtp drafts). Their experts sit in the slots of the default placement: a map with redundant or
    moved experts (EPLB) covers the decoder's MoE layers only, so it is refused with them.
    `indexer_key_dtype`: `EngineConfig.indexer_key_dtype` (FP8 indexer keys or not).

    The rank's physical expert slots are `dispatcher.placement`'s, and `expert_map` says which
    logical expert each holds (None: slot e holds expert e, no redundant experts); without a
    dispatcher the model holds every slot and uses the `local` backend. Under tensor parallelism the attention
    layers declare which part of each tensor this rank holds (`tensor_parallel.Shard`).
    """
    reader = CheckpointReader(folder)
    arch, cfg = resolve_architecture(reader.config)
    cfg = cfg.with_indexer_key_dtype(indexer_key_dtype)
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
    if with_mtp:
        _check_mtp(cfg, expert_map, reader, arch.names)
    model_cls = MoECausalLM if cfg.compressed_attention is None else DeepseekV4CausalLM
    model = model_cls(cfg, dispatcher, dtype, device, tp, ops, with_mtp)
    experts_by_layer = {layer: expert_map.local_logical(i, placement.rank) for i, layer in enumerate(moe_layers)}
    for i in range(len(model.mtp)):
        experts_by_layer[cfg.num_layers + i] = expert_map.local_logical(0, placement.rank)
    targets = {name: p for name, p in model.named_parameters()}
    names = checkpoint_names(arch.names, cfg, reader)
    if cfg.compressed_attention is not None:
        layout = layout_of(reader)
        sources = {name: v4_source(name, layout, experts_by_layer, cfg.num_layers) for name in targets}
    else:
        sources = {
            name: rows_source(name, param, names)
            or weight_source(name, names, experts_by_layer, cfg.num_experts, cfg.num_layers)
            for name, param in targets.items()
        }
    mxfp4 = mxfp4_sources(sources, targets, reader, cfg.weight_quant)
    packed, dequantized = {}, {}
    if isinstance(cfg.weight_quant, PackedInt4Config | NVFP4Config):
        packed, dequantized = packed_sources(cfg.weight_quant, sources, reader)
        for name, source in dequantized.items():
            source.check(reader, checkpoint_shape(targets[name]))
    elif isinstance(cfg.weight_quant, BlockFP8Config) and cfg.weight_quant.fp4_experts:
        packed = fp4_expert_sources(sources)
    for name, source in packed.items():
        source.check(reader, targets[name].shape)
    plain = {
        name: s for name, s in sources.items() if name not in mxfp4 and name not in packed and name not in dequantized
    }
    check_sources(plain, targets, reader)
    fp8_quant = cfg.weight_quant if isinstance(cfg.weight_quant, BlockFP8Config) else None
    fp8, fp8_dequantized = fp8_sources(plain, reader, fp8_quant)
    dequantized.update(fp8_dequantized)
    block = fp8_quant.block if fp8_quant is not None else (0, 0)
    for name in [n for n in fp8 if _fp8_dequantized_at_load(model, n)]:
        dequantized[name] = FP8DequantizedSource(fp8.pop(name), block)
    storage = {}
    for name in mxfp4:
        module, attr = name.rsplit(".", 1)
        storage[name] = pack_parameter(model.get_submodule(module), attr, MXFP4Format(), 1)
    for name, source in packed.items():
        module, attr = name.rsplit(".", 1)
        storage[name] = pack_parameter(model.get_submodule(module), attr, source.fmt, len(source.modules[0]))
    for name, source in fp8.items():
        module, attr = name.rsplit(".", 1)
        grid = scale_grid(source, reader, block, shard_of(targets[name]))
        storage[name] = quantize_parameter(model.get_submodule(module), attr, fp8_parts(source), block, grid)
    with torch.no_grad():
        for name, param in targets.items():
            source = mxfp4.get(name) or packed.get(name) or dequantized.get(name) or fp8.get(name) or sources[name]
            fp8_block = block if name in fp8 else None
            # Router correction bias and fp32 gates keep their own dtype (see Router).
            held = read_held(source, reader, param.dtype, fp8_block, shard_of(param))
            for stored, value in zip(storage.get(name, (param,)), held, strict=True):
                stored.copy_(value)
        if cfg.zero_centered_norms:
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)  # the checkpoint stores w for a scale of 1 + w
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
        _quantized_note(fp8, mxfp4, packed, dequantized),
    )
    return model


def _fp8_dequantized_at_load(model: nn.Module, name: str) -> bool:
    """Whether FP8 parameter `name` is read dequantized: its layer has no FP8 product."""
    return getattr(model.get_submodule(name.rsplit(".", 1)[0]), "fp8_dequantized_at_load", False)


def _quantized_note(fp8: dict, mxfp4: dict, packed: dict[str, PackedExpertsSource], dequantized: dict) -> str:
    """What the load log says of the quantized parameters."""
    kept = [f"{len(fp8)} parameters in FP8"] if fp8 else []
    if mxfp4:
        kept.append(f"{len(mxfp4)} parameters in MXFP4")
    if packed:
        kept.append(f"{len(packed)} parameters in {next(iter(packed.values())).fmt.name}")
    if dequantized:
        kept.append(f"{len(dequantized)} more dequantized at load")
    return "".join(f", {k}" for k in kept)


def checkpoint_names(names: CheckpointNames, cfg: ModelConfig, reader: CheckpointReader) -> CheckpointNames:
    """`names`, but experts one tensor per expert and projection where an architecture released
    with stacked experts (`fused_layout` rows: Qwen3.5) was saved by transformers, which writes
    them per expert."""
    if not (names.fused_experts and names.fused_layout == "rows" and cfg.moe_layer_indices):
        return names
    first = f"{names.model_prefix}layers.{cfg.moe_layer_indices[0]}.{names.moe}.experts.gate_up_proj"
    return names if first in reader else dataclasses.replace(names, fused_experts=False)


def _check_mtp(cfg: ModelConfig, expert_map: ExpertMap, reader: CheckpointReader, names: CheckpointNames) -> None:
    """MTP drafts need the checkpoint's MTP layers and an expert map their MoE can share."""
    if not cfg.num_mtp_layers:
        raise ValueError(
            f"speculative_config method 'mtp' needs multi-token prediction weights, and this {cfg.architecture} "
            "checkpoint has none (config.json's num_nextn_predict_layers is 0 or absent)"
        )
    if names.mtp_layout == "qwen" and cfg.num_mtp_layers > 1:
        raise ValueError(
            f"speculative_config method 'mtp': {cfg.architecture} with {cfg.num_mtp_layers} MTP layers "
            "(one fc feeding them all) is not built; the releases have one"
        )
    if cfg.compressed_attention is not None and cfg.num_mtp_layers > 1:
        raise ValueError(
            f"speculative_config method 'mtp': {cfg.architecture} with {cfg.num_mtp_layers} MTP blocks is not "
            "built (its drafter chains one block); the releases have one"
        )
    if cfg.compressed_attention is not None:
        first = "mtp.0.e_proj.weight"
    elif names.mtp_layout == "qwen":
        first = "mtp.fc.weight"
    else:
        first = f"{names.model_prefix}layers.{cfg.num_layers}.eh_proj.weight"
    if first not in reader:
        raise ValueError(
            f"speculative_config method 'mtp': config.json's num_nextn_predict_layers is {cfg.num_mtp_layers}, "
            f"but the checkpoint holds no MTP layer ({first} is missing; transformers saves none)"
        )
    if not cfg.moe_layer_indices:
        raise ValueError("speculative_config method 'mtp' needs MoE layers (MTP layers are MoE layers)")
    if not expert_map.is_identity:
        raise ValueError(
            "speculative_config method 'mtp' runs with each expert in its default slot only "
            "(no redundant experts, no expert placement or rebalancing)"
        )


class ExpertReader:
    """Logical experts' weights read from the checkpoint and stacked as an MoE layer holds them:
    what a survivor of lost ranks loads for experts no surviving rank holds (`eplb.recovery`).
    A quantized parameter gives its stored bytes and its scales, as `load_model` holds them for a
    rank whose slots hold those experts (`read_held`)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype) -> None:
        self._reader = CheckpointReader(folder)
        arch, self._cfg = resolve_architecture(self._reader.config)
        self._names, self._dtype = checkpoint_names(arch.names, self._cfg, self._reader), dtype

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
                if isinstance(quant, PackedWeight) and isinstance(quant.fmt, MXFP4Format):
                    source = MXFP4ExpertsSource(source.name, source.experts, source.num_experts, source.layout)
                elif isinstance(quant, PackedWeight):
                    modules = tuple(tuple(n.removesuffix(".weight") for n in part) for part in source.parts)
                    source = PackedExpertsSource(modules, quant.fmt)
                elif isinstance(quant, BlockFP8):
                    fp8_block = quant.block
                else:
                    raise TypeError(f"experts.{param} is under an unknown parametrization {type(quant).__name__}")
            elif any(self._reader.dtype(name) == FP8_TENSOR for name in source.names):
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


def model_config(folder: str | Path, indexer_key_dtype: str = "auto") -> ModelConfig:
    """The normalised config of a checkpoint, without reading any weight, with the engine's
    `indexer_key_dtype` applied (what sizes the cache must agree with what `load_model` builds)."""
    return resolve_architecture(CheckpointReader(folder).config)[1].with_indexer_key_dtype(indexer_key_dtype)
