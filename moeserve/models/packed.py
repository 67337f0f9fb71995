"""Routed experts kept in a packed 4-bit format: compressed-tensors INT4 (`models/int4.py`),
ModelOpt NVFP4 (`models/nvfp4.py`) and gpt-oss's MXFP4 (`models/mxfp4.py`); and any other linear
layer an INT4 / NVFP4 release quantizes, dequantized at load (`DequantizedSource`).

One interface, `PackedFormat`, with a backend per format: what a parameter holds, how the held
bytes turn into values, and what the kernels are handed. A layer's `w13` `[E_local, 2I, H]` /
`w2` `[E_local, H, I]` are stored as the checkpoint's codes, outputs first (gate rows then up
rows: every scale runs along a row, so the parts concatenate untouched), and a
`torch.nn.utils.parametrize` parametrization turns them into the compute dtype at each read,
holding the scales as parameters of the experts module, so an expert rebalance moves codes and
scales together. The formats that store one tensor set per expert and projection (INT4, NVFP4)
are `PerModuleFormat`s, which also say what a checkpoint module's tensors must be (checked
before anything is read, each refusal naming the tensor and the field) and how a rank reads them
as one expert's rows; MXFP4's stacked per-layer tensors are read by `MXFP4ExpertsSource`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from moeserve.models.checkpoint import CheckpointError, CheckpointReader
from moeserve.models.tensor_parallel import Shard
from moeserve.packed_weight import PackedExperts

Storage = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""(shape, dtype) of each tensor a packed parameter holds: the codes first, then the scales."""


class PackedFormat(ABC):
    """One packed format's backend (stateless but for the checkpoint's settings)."""

    name: str  # as logs and refusals say it
    held: tuple[str, ...]  # the parametrization's parameters beside the codes, in `Storage` order

    @abstractmethod
    def storage(self, shape: tuple[int, ...], parts: int) -> Storage:
        """What a parameter of `shape` `[E, rows, cols]` concatenating `parts` modules holds."""

    @abstractmethod
    def dequantize(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
        """The values `[..., rows, cols]` in `dtype` of `codes` with the `held` scales."""

    @abstractmethod
    def packed_experts(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...]) -> PackedExperts | None:
        """What the ops backend is handed for the experts: `PackedExperts` where a packed
        grouped GEMM takes the format, else None (the experts are read dequantized)."""


class PerModuleFormat(PackedFormat):
    """A format whose checkpoints store one tensor set per module (`<module>.<suffix>`)."""

    suffixes: tuple[str, ...]  # a module's checkpoint tensors: `<module>.<suffix>`

    @abstractmethod
    def check(self, reader: CheckpointReader, module: str, rows: int, cols: int) -> None:
        """`module`'s tensors are present, of the dtypes and shapes a `[rows, cols]` weight has."""

    @abstractmethod
    def read(self, reader: CheckpointReader, modules: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """One expert's tensors in `Storage` order (without the expert dim), `modules` joined
        along the rows; a malformed scale is refused by the tensor's name."""

    def packed_experts(self, codes: torch.Tensor, held: tuple[torch.Tensor, ...]) -> PackedExperts:
        return PackedExperts(codes, *held)

    def tensors(self, module: str) -> list[str]:
        """The checkpoint tensors of `module` this format reads."""
        return [f"{module}.{suffix}" for suffix in self.suffixes]


def expect(reader: CheckpointReader, tensor: str, dtypes: tuple[str, ...], shape: tuple[int, ...], what: str) -> None:
    """`tensor` present with one of `dtypes` and `shape`, else a refusal naming it and `what` it is."""
    if tensor not in reader:
        raise CheckpointError(f"checkpoint {reader.folder} is missing tensor {tensor} ({what})")
    if reader.dtype(tensor) not in dtypes or reader.shape(tensor) != shape:
        raise CheckpointError(
            f"tensor {tensor} is {reader.dtype(tensor)} {list(reader.shape(tensor))}, "
            f"expected {' or '.join(dtypes)} {list(shape)} ({what})"
        )


def read_scales(
    reader: CheckpointReader, modules: tuple[str, ...], suffix: str, positive: bool = False
) -> list[torch.Tensor]:
    """Each module's `<module>.<suffix>` scales, every entry finite (and > 0 with `positive`),
    else a refusal naming the tensor and the first bad entry."""
    read = []
    for module in modules:
        tensor, value = f"{module}.{suffix}", reader.get(f"{module}.{suffix}")
        values = value.float()
        bad = ~torch.isfinite(values) | ((values <= 0) if positive else torch.zeros_like(values, dtype=torch.bool))
        if bad.any():
            where = tuple(int(i) for i in bad.nonzero()[0]) if values.dim() else ()
            raise CheckpointError(
                f"tensor {tensor} holds {values[where].item()} at {list(where)}: scales must be finite"
                + (" and positive" if positive else "")
            )
        read.append(value)
    return read


class PackedWeight(nn.Module):
    """The parametrization of one packed expert parameter: holds its scales and turns the codes
    into `dtype` on every read."""

    def __init__(self, fmt: PackedFormat, held: tuple[torch.Tensor, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.fmt = fmt
        self.dtype = dtype
        for name, tensor in zip(fmt.held, held, strict=True):
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.fmt.dequantize(codes, self.held(), self.dtype)

    def held(self) -> tuple[torch.Tensor, ...]:
        """The scales beside the codes, in `fmt.held` order (the `PackedExperts` fields after codes)."""
        return tuple(getattr(self, n) for n in self.fmt.held)


def pack_parameter(module: nn.Module, name: str, fmt: PackedFormat, parts: int) -> tuple[nn.Parameter, ...]:
    """Replace `module.<name>` (`[E_local, rows, cols]`) by `fmt`'s storage; reads keep the old
    parameter's dtype and shape. Returns the held tensors, codes first, for the loader to fill."""
    old = getattr(module, name)
    codes, *held = (torch.empty(s, dtype=d, device=old.device) for s, d in fmt.storage(tuple(old.shape), parts))
    setattr(module, name, nn.Parameter(codes, requires_grad=False))
    # unsafe: the parametrization changes dtype and shape (packed storage, compute-dtype reads).
    parametrize.register_parametrization(module, name, PackedWeight(fmt, tuple(held), old.dtype), unsafe=True)
    param_list = module.parametrizations[name]
    return (param_list.original, *(getattr(param_list[0], n) for n in fmt.held))


@dataclass(frozen=True)
class PackedExpertsSource:
    """A packed expert parameter's checkpoint modules: per local expert, the modules its rows
    concatenate (gate then up, or down), each read only for this rank's experts."""

    modules: tuple[tuple[str, ...], ...]
    fmt: PerModuleFormat

    @property
    def names(self) -> list[str]:
        return [t for part in self.modules for m in part for t in self.fmt.tensors(m)]

    def check(self, reader: CheckpointReader, target: torch.Size) -> None:
        """Every module's tensors as our parameter `[E_local, parts * rows, cols]` implies."""
        rows, cols = target[1] // len(self.modules[0]), target[2]
        for part in self.modules:
            for module in part:
                self.fmt.check(reader, module, rows, cols)

    def read(self, reader: CheckpointReader) -> tuple[torch.Tensor, ...]:
        per_expert = [self.fmt.read(reader, part) for part in self.modules]
        return tuple(torch.stack(tensors) for tensors in zip(*per_expert, strict=True))


@dataclass(frozen=True)
class DequantizedSource:
    """A linear layer other than the routed experts that the config quantizes (attention, shared
    experts, dense MLPs, the LM head): its modules (gate then up where our parameter fuses
    them) read packed and dequantized on the CPU at load into the compute dtype. Such layers are
    a small share of a release's bytes, and every kernel and tensor-parallel cut takes them
    dense: a rank dequantizes the whole tensor and keeps its slice, so no cut falls inside a
    group."""

    modules: tuple[str, ...]
    fmt: PerModuleFormat

    @property
    def names(self) -> list[str]:
        return [t for m in self.modules for t in self.fmt.tensors(m)]

    def check(self, reader: CheckpointReader, shape: tuple[int, ...]) -> None:
        """Every module's tensors as our parameter, whole (`shape`, before any tensor-parallel cut), implies."""
        rows, cols = shape[0] // len(self.modules), shape[1]
        for module in self.modules:
            self.fmt.check(reader, module, rows, cols)

    def read(self, reader: CheckpointReader, dtype: torch.dtype, shard: Shard | None) -> torch.Tensor:
        codes, *held = self.fmt.read(reader, self.modules)
        value = self.fmt.dequantize(codes, tuple(held), dtype)
        return value if shard is None else shard.take(value).contiguous()
