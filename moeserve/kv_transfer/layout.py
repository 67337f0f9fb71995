"""Where each block of a paged KV cache lies in memory, so another process can write into it.

A layer's cache is one contiguous tensor whose blocks are rows of one or more planes: GQA keeps
keys and values in two planes `[2, num_blocks, block_size, heads, head_dim]`, MLA its latent cache
in one `[num_blocks, block_size, rank + rope]` (a DSA layer its indexer keys too, one more tensor
of its own shape: `layouts_of` makes a layout per kind). A block of a layer is then `planes` regions of
`block_bytes`, and a run of consecutive block ids on both sides moves as one region per plane:
no staging copy, the transfer reads and writes the caches themselves.

A Gated DeltaNet layer keeps no blocks but a state per sequence; what moves of it is the state
saved at the prompt's last full block (prefix caching's saved-state slots, `LinearState.saved_*`):
one region per saved tensor (the conv state and the recurrent state) at the slot each side names.

A model whose paged tensors form several block-table groups (DeepSeek-V4's window, compressed
entries and indexer keys, `GroupedCache`) has a layout per group and kind (`KvLayout.group`), each
moving its own group's block ids; the layers' saved open-window states ride with the first
layout, as Gated DeltaNet's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class StateCache(Protocol):
    """A state layer's cache as a transfer reads it (`ops.state_batch.LinearState`; named by its
    shape, not imported, so this package stays below the model code): its saved-state tensors,
    None where prefix caching allocated none."""

    saved_conv: torch.Tensor | None
    saved_recurrent: torch.Tensor | None


class GroupedCache(Protocol):
    """A layer's cache whose paged tensors lie in several block-table groups
    (`models.v4.cache.LayerCache`, named by its shape): each paged tensor's group (its index among
    the model's groups), and its saved states (prefix caching's, slot-major)."""

    paged: tuple[torch.Tensor, ...]
    paged_groups: tuple[int, ...]
    saved: tuple[torch.Tensor, ...]


Cache = torch.Tensor | tuple[torch.Tensor, ...] | StateCache | GroupedCache
"""A layer's cache: its block tensor, its several (a DSA layer's latent and indexer keys), its
state, or its tensors of several groups."""


def is_grouped(cache: Cache) -> bool:
    return hasattr(cache, "paged_groups")


Region = tuple[int, int, int]
"""(address, bytes, device id), as NIXL describes memory."""
Blocks = Sequence[int]
"""Block ids of one side of a write, in the prompt's order."""
BlocksByGroup = Sequence[Blocks]
"""Block ids of one side of a write per block-table group, in the groups' order (one list for a
model with one group)."""
Slots = tuple[int, int]
"""(source, destination) saved-state slots of a write; -1 each for none."""
NO_STATE: Slots = (-1, -1)


@dataclass(frozen=True)
class KvLayout:
    layer_bases: tuple[int, ...]
    """Address of each layer's cache tensor."""
    planes: int
    plane_bytes: int
    """Bytes between a block's planes (one plane of the whole layer)."""
    block_bytes: int
    """Bytes of one block in one plane."""
    device_id: int = 0
    mem_type: str = "DRAM"
    """NIXL's memory kind: DRAM (CPU) or VRAM (GPU)."""
    state_bases: tuple[int, ...] = ()
    """Address of each state layer's saved conv and saved recurrent tensors, in that order."""
    state_slot_bytes: tuple[int, ...] = ()
    """Bytes of one saved-state slot in each of `state_bases`' tensors."""
    group: int = 0
    """The block-table group whose block ids address these tensors (0 with one group)."""

    @classmethod
    def of(cls, caches: Sequence[Cache], group: int = 0) -> KvLayout:
        caches, states = paged_caches(caches), saved_states(caches)
        first = caches[0]
        if not all(c.is_contiguous() and c.shape == first.shape and c.dtype == first.dtype for c in caches):
            raise ValueError("KV transfer needs contiguous layer caches of one shape and dtype")
        if not all(s.is_contiguous() for s in states):
            raise ValueError("KV transfer needs contiguous saved states")
        planes = first.shape[0] if first.dim() == 5 else 1  # GQA's K and V, or MLA's single latent plane
        num_blocks = first.shape[1] if first.dim() == 5 else first.shape[0]
        plane_bytes = first.nbytes // planes
        device_id = first.device.index or 0
        mem_type = "VRAM" if first.device.type == "cuda" else "DRAM"
        bases = tuple(c.data_ptr() for c in caches)
        state_bases = tuple(s.data_ptr() for s in states)
        slot_bytes = tuple(s.nbytes // s.shape[0] for s in states)
        block_bytes = plane_bytes // num_blocks
        return cls(bases, planes, plane_bytes, block_bytes, device_id, mem_type, state_bases, slot_bytes, group)

    @property
    def shape_key(self) -> tuple[int, int, int, tuple[int, ...], int]:
        """What two sides must share for a block (and a state) to mean the same bytes: layers,
        planes, block size, the bytes of each state tensor's slot, and the block-table group."""
        return (len(self.layer_bases), self.planes, self.block_bytes, self.state_slot_bytes, self.group)

    def regions(self, runs: Sequence[tuple[int, int]], state_slot: int = -1) -> list[Region]:
        """The regions of `runs` (first block id, block count), layer by layer, plane by plane;
        then, for a `state_slot` >= 0, that saved-state slot's in each state tensor."""
        blocks = [
            (base + plane * self.plane_bytes + first * self.block_bytes, count * self.block_bytes, self.device_id)
            for base in self.layer_bases
            for plane in range(self.planes)
            for first, count in runs
        ]
        if state_slot < 0:
            return blocks
        states = zip(self.state_bases, self.state_slot_bytes, strict=True)
        return blocks + [(base + state_slot * size, size, self.device_id) for base, size in states]

    def num_bytes(self, num_blocks: int, with_state: bool) -> int:
        """Bytes `num_blocks` blocks of every layer move, with one saved state or without."""
        state = sum(self.state_slot_bytes) if with_state else 0
        return num_blocks * self.block_bytes * self.planes * len(self.layer_bases) + state

    def to_json(self) -> dict:
        return {
            "layer_bases": list(self.layer_bases),
            "planes": self.planes,
            "plane_bytes": self.plane_bytes,
            "block_bytes": self.block_bytes,
            "device_id": self.device_id,
            "mem_type": self.mem_type,
            "state_bases": list(self.state_bases),
            "state_slot_bytes": list(self.state_slot_bytes),
            "group": self.group,
        }

    @classmethod
    def from_json(cls, data: dict) -> KvLayout:
        fields = ("planes", "plane_bytes", "block_bytes", "device_id", "mem_type")
        states = (tuple(data.get(name, ())) for name in ("state_bases", "state_slot_bytes"))
        return cls(tuple(data["layer_bases"]), *(data[name] for name in fields), *states, data.get("group", 0))


def paged_caches(caches: Sequence[Cache]) -> list[torch.Tensor]:
    """The block caches among `caches` (a state layer has none)."""
    return [c for c in caches if isinstance(c, torch.Tensor)]


def saved_states(caches: Sequence[Cache]) -> list[torch.Tensor]:
    """The saved-state tensors: a state layer's conv then recurrent (none without prefix caching,
    which allocates them), a grouped layer's open-window states."""
    saved: list[torch.Tensor] = []
    for c in caches:
        if is_grouped(c):
            saved.extend(c.saved)
        elif not isinstance(c, torch.Tensor | tuple):
            saved.extend(t for t in (c.saved_conv, c.saved_recurrent) if t is not None)
    return saved


def layouts_of(caches: Sequence[Cache]) -> tuple[KvLayout, ...]:
    """The paged tensors of a model's layers as one layout per group and kind of tensor (shape and
    dtype), in the order each first appears: every kind of a group has the same block ids, so a
    transfer moves the same runs in each. The saved states ride with the first layout."""
    kinds: dict[tuple[int, tuple[int, ...], torch.dtype], list[Cache]] = {}
    for group, tensor in _paged_tensors(caches):
        kinds.setdefault((group, tuple(tensor.shape), tensor.dtype), []).append(tensor)
    holders = [c for c in caches if not isinstance(c, torch.Tensor | tuple)]  # of saved states
    return tuple(
        KvLayout.of([*tensors, *(holders if i == 0 else ())], group)
        for i, ((group, _, _), tensors) in enumerate(kinds.items())
    )


def registered_tensors(caches: Sequence[Cache]) -> list[torch.Tensor]:
    """What a transfer agent registers: every paged tensor, then every saved state."""
    return [tensor for _, tensor in _paged_tensors(caches)] + saved_states(caches)


def _paged_tensors(caches: Sequence[Cache]) -> list[tuple[int, torch.Tensor]]:
    """Every paged tensor with its block-table group (0 for a model with one)."""
    paged: list[tuple[int, torch.Tensor]] = []
    for c in caches:
        if isinstance(c, torch.Tensor | tuple):
            paged.extend((0, t) for t in (c if isinstance(c, tuple) else (c,)))
        elif is_grouped(c):
            paged.extend(zip(c.paged_groups, c.paged, strict=True))
    return paged


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split two equally long block lists into runs consecutive on both sides: (first, count) each."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    src_runs: list[tuple[int, int]] = []
    dst_runs: list[tuple[int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if src_runs and s == sum(src_runs[-1]) and d == sum(dst_runs[-1]):
            src_runs[-1] = (src_runs[-1][0], src_runs[-1][1] + 1)
            dst_runs[-1] = (dst_runs[-1][0], dst_runs[-1][1] + 1)
        else:
            src_runs.append((s, 1))
            dst_runs.append((d, 1))
    return src_runs, dst_runs
