"""Where each block of a paged KV cache lies in memory, so another process can write into it.

A layer's cache is one contiguous tensor whose blocks are rows of one or more planes: GQA keeps
keys and values in two planes `[2, num_blocks, block_size, heads, head_dim]`, MLA its latent cache
in one `[num_blocks, block_size, rank + rope]` (a DSA layer its indexer keys too, one more tensor
of its own shape: `layouts_of` makes a layout per kind). A block of a layer is then `planes` regions of
`block_bytes`, and a run of consecutive block ids on both sides moves as one region per plane:
no staging copy, the transfer reads and writes the caches themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Region = tuple[int, int, int]
"""(address, bytes, device id), as NIXL describes memory."""


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

    @classmethod
    def of(cls, caches: Sequence[torch.Tensor]) -> KvLayout:
        first = caches[0]
        if not all(c.is_contiguous() and c.shape == first.shape and c.dtype == first.dtype for c in caches):
            raise ValueError("KV transfer needs contiguous layer caches of one shape and dtype")
        planes = first.shape[0] if first.dim() == 5 else 1  # GQA's K and V, or MLA's single latent plane
        num_blocks = first.shape[1] if first.dim() == 5 else first.shape[0]
        plane_bytes = first.nbytes // planes
        device_id = first.device.index or 0
        mem_type = "VRAM" if first.device.type == "cuda" else "DRAM"
        bases = tuple(c.data_ptr() for c in caches)
        return cls(bases, planes, plane_bytes, plane_bytes // num_blocks, device_id, mem_type)

    def bytes_of(self, num_blocks: int) -> int:
        """Bytes `num_blocks` blocks take over every layer and plane."""
        return num_blocks * self.block_bytes * self.planes * len(self.layer_bases)

    @property
    def shape_key(self) -> tuple[int, int, int]:
        """What two sides must share for a block to mean the same bytes: layers, planes, block size."""
        return (len(self.layer_bases), self.planes, self.block_bytes)

    def regions(self, runs: Sequence[tuple[int, int]]) -> list[Region]:
        """The regions of `runs` (first block id, block count), layer by layer, plane by plane."""
        return [
            (base + plane * self.plane_bytes + first * self.block_bytes, count * self.block_bytes, self.device_id)
            for base in self.layer_bases
            for plane in range(self.planes)
            for first, count in runs
        ]

    def to_json(self) -> dict:
        return {
            "layer_bases": list(self.layer_bases),
            "planes": self.planes,
            "plane_bytes": self.plane_bytes,
            "block_bytes": self.block_bytes,
            "device_id": self.device_id,
            "mem_type": self.mem_type,
        }

    @classmethod
    def from_json(cls, data: dict) -> KvLayout:
        fields = ("planes", "plane_bytes", "block_bytes", "device_id", "mem_type")
        return cls(tuple(data["layer_bases"]), *(data[name] for name in fields))


def layouts_of(caches: Sequence[torch.Tensor | tuple[torch.Tensor, ...]]) -> tuple[KvLayout, ...]:
    """The paged tensors of a model's layers (a DSA layer's latent and indexer keys: a tuple) as
    one layout per kind of tensor (shape and dtype), in the order each kind first appears: every
    kind's blocks are the same block ids, so a transfer moves the same runs in each."""
    kinds: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
    for cache in caches:
        for tensor in cache if isinstance(cache, tuple) else (cache,):
            kinds.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
    return tuple(KvLayout.of(tensors) for tensors in kinds.values())


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
