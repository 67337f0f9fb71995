"""Which checkpoint tensors each of our parameters comes from, checked before and read at load.

Each parameter maps to one or more checkpoint tensors (`WeightSource`): gate and up projections
are concatenated into one GEMM, and an MoE layer's experts are stacked into one tensor, of only
the experts a rank's slots hold. gpt-oss stores a layer's experts as one tensor per projection
(`FusedExpertsSource`), in its own column order. `check_sources` checks presence and shape of
every source before any tensor is read, so a bad checkpoint fails with one message.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

import torch

from moeserve.models.architectures import CheckpointNames
from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.tensor_parallel import Shard, rows_of, shard_of


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


FusedLayout = Literal["gate_up", "gate_up_bias", "down", "down_bias", "rows"]


@dataclass(frozen=True)
class FusedExpertsSource:
    """Rows `experts` of one checkpoint tensor stacking all `num_experts` experts of a layer
    (gpt-oss), each turned into our layout:

    gate_up      `[E, H, 2I]`, gate and up columns interleaved -> w13 `[2I, H]`, gate rows then up rows
    gate_up_bias `[E, 2I]`, interleaved alike                   -> b13 `[2I]`
    down         `[E, I, H]`                                     -> w2 `[H, I]`
    down_bias    `[E, H]`                                        -> b2 `[H]`
    rows         `[E, out, in]`, ours already (transformers 5, Qwen3.5) -> as it is
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
        if self.layout == "rows":
            return t
        if self.layout in ("gate_up", "down"):
            t = t.t()
        if self.layout in ("gate_up", "gate_up_bias"):
            t = torch.cat((t[0::2], t[1::2]))
        return t.contiguous()


@dataclass(frozen=True)
class RowsSource:
    """Rows `rows` of one checkpoint tensor of `full` rows (see `tensor_parallel.Rows`)."""

    name: str
    rows: tuple[int, ...]
    full: int

    @property
    def names(self) -> list[str]:
        return [self.name]

    def expected_shape(self, target: torch.Size) -> tuple[int, ...]:
        return (self.full, *target[1:])

    def read(self, reader: CheckpointReader, dtype: torch.dtype) -> torch.Tensor:
        return reader.get(self.name).to(dtype)[torch.tensor(self.rows, dtype=torch.int64)]


def rows_source(name: str, param: torch.Tensor, names: CheckpointNames) -> RowsSource | None:
    """The source of a decoder layer's parameter tagged with its checkpoint rows, else None."""
    rows = rows_of(param)
    if rows is None:
        return None
    layer = re.fullmatch(r"layers\.(\d+)\..+", name)
    if layer is None:
        raise KeyError(f"parameter {name!r} is tagged with checkpoint rows but is not a decoder layer's")
    return RowsSource(f"{names.model_prefix}layers.{layer.group(1)}.{rows.tensor}", rows.rows, rows.full)


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
    p = f"{names.model_prefix}layers.{layer}."
    moe = f"{p}{names.moe}."
    if names.fused_experts and suffix in _FUSED:
        tensor, layout = _FUSED[suffix]
        if names.fused_layout == "rows":
            layout = "rows"
        return FusedExpertsSource(f"{moe}experts.{tensor}", local_experts, num_experts, layout)
    if suffix in _COMMON:
        return WeightSource.one(p + _COMMON[suffix])
    if suffix.startswith("attn."):
        return WeightSource.one(p + "self_attn." + suffix[len("attn.") :])
    if suffix.startswith("linear_attn."):  # named as in the checkpoint (projections: `rows_source`)
        return WeightSource.one(p + suffix)
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


# An MTP layer's own tensors (ours -> checkpoint suffix after `model.layers.{num_layers + i}.`).
_MTP = {
    "embed_tokens": "embed_tokens.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
    "head": "shared_head.head.weight",
}


# The same for Qwen3-Next's and Qwen3.5's one MTP layer (ours -> the checkpoint's, after `mtp.`).
_QWEN_MTP = {
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "eh_proj": "fc.weight",
    "head_norm.weight": "norm.weight",
}


def _qwen_mtp_source(
    index: int,
    suffix: str,
    names: CheckpointNames,
    experts_by_layer: dict[int, tuple[int, ...]],
    num_experts: int,
    num_layers: int,
) -> WeightSource | FusedExpertsSource:
    """MTP layer `index`'s `suffix` in a Qwen3-Next / Qwen3.5 checkpoint: its own tensors under
    `mtp.`, its decoder layer as `mtp.layers.{index}.`, the embedding and head the target's."""
    if suffix == "embed_tokens":
        return WeightSource.one(f"{names.model_prefix}embed_tokens.weight")
    if suffix == "head":
        return WeightSource.one(names.lm_head)
    if suffix in _QWEN_MTP:
        return WeightSource.one(f"mtp.{_QWEN_MTP[suffix]}")
    if not suffix.startswith("layer."):
        raise KeyError(f"no checkpoint mapping for parameter mtp.{index}.{suffix}")
    mtp_names = dataclasses.replace(names, model_prefix="mtp.")
    local = experts_by_layer.get(num_layers + index, ())
    return layer_source(index, suffix[len("layer.") :], mtp_names, local, num_experts)


_DECODER_TOP_LEVEL = {
    "embed_tokens": "embed_tokens.weight",
    "norm.weight": "norm.weight",
}  # ours -> the checkpoint's, after `model_prefix`


def weight_source(
    name: str,
    names: CheckpointNames,
    experts_by_layer: dict[int, tuple[int, ...]],
    num_experts: int,
    num_layers: int = 0,
) -> WeightSource | FusedExpertsSource:
    """experts_by_layer: decoder layer -> the checkpoint expert in each of this rank's slots (MTP
    layer i is decoder layer `num_layers + i`, as checkpoints number it)."""
    mtp = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if mtp is not None and names.mtp_layout == "qwen":
        return _qwen_mtp_source(int(mtp.group(1)), mtp.group(2), names, experts_by_layer, num_experts, num_layers)
    if mtp is not None:
        layer, suffix = num_layers + int(mtp.group(1)), mtp.group(2)
        if suffix in _MTP:
            return WeightSource.one(f"{names.model_prefix}layers.{layer}.{_MTP[suffix]}")
        if not suffix.startswith("layer."):
            raise KeyError(f"no checkpoint mapping for parameter {name!r}")
        return layer_source(layer, suffix[len("layer.") :], names, experts_by_layer.get(layer, ()), num_experts)
    if name == "lm_head":
        return WeightSource.one(names.lm_head)
    if name in _DECODER_TOP_LEVEL:
        return WeightSource.one(f"{names.model_prefix}{_DECODER_TOP_LEVEL[name]}")
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(f"no checkpoint mapping for parameter {name!r}")
    layer = int(match.group(1))
    return layer_source(layer, match.group(2), names, experts_by_layer.get(layer, ()), num_experts)


def _expected_part_shape(source: WeightSource, target: torch.Size) -> tuple[int, ...]:
    """Shape the first tensor of each part must have (parts split target's dim 0 evenly)."""
    per_part = target[1:] if source.stacked else target
    return (per_part[0] // len(source.parts[0]), *per_part[1:])


def checkpoint_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor a (possibly tensor-parallel sharded) parameter comes from."""
    shard = shard_of(param)
    return param.shape if shard is None else torch.Size(shard.full_shape(param.shape))


Source = WeightSource | FusedExpertsSource | RowsSource


def check_sources(sources: dict[str, Source], targets: dict[str, torch.Tensor], reader: CheckpointReader) -> None:
    """Every tensor present with the shape our parameter expects; otherwise one clear error."""
    missing = [n for s in sources.values() for n in s.names if n not in reader]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {reader.folder} is missing tensors: {', '.join(missing[:5])}{more}")
    for name, source in sources.items():
        if isinstance(source, FusedExpertsSource | RowsSource):
            want = source.expected_shape(targets[name].shape)
        else:
            want = _expected_part_shape(source, checkpoint_shape(targets[name]))
        for tensor_name in source.names:
            got = reader.shape(tensor_name)
            if got != want:
                raise CheckpointError(
                    f"tensor {tensor_name} has shape {list(got)}, expected {list(want)} from config.json"
                )


def read_source(
    source: Source, reader: CheckpointReader, dtype: torch.dtype, shard: Shard | None = None
) -> torch.Tensor:
    """The parameter's value; a sharded one (always a single checkpoint tensor) reads only its part."""
    if isinstance(source, FusedExpertsSource | RowsSource):
        return source.read(reader, dtype)
    if shard is not None:
        (name,) = source.names
        part = reader.get_part(name, shard.dim, shard.start, shard.length).to(dtype)
        return torch.zeros_like(part) if shard.zeros else part
    parts = [torch.cat([reader.get(n).to(dtype) for n in part], dim=0) for part in source.parts]
    return torch.stack(parts) if source.stacked else parts[0]
