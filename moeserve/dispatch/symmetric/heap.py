"""Symmetric memory: every PE (rank) allocates the same buffers, and each may store into its peers'.

This is the one trick under NVLink all-to-all (DeepEP's intranode and low-latency paths, pplx's
NVLink path): a rank holds the addresses of its peers' copies of a buffer and its kernels store
into them directly, then raise a signal word there. A `SymmetricHeap` hands out such buffers; the
transports behind it differ only in how the peers' copies come to be addressable:

* `emulated`: N PEs inside one process, each copy an ordinary tensor (CI, one GPU running N PEs);
* `shm`:      rank processes on one CPU machine, each copy a shared-memory file every rank maps;
* `nvshmem`:  GPUs, copies on the NVSHMEM symmetric heap, peers' addresses from `nvshmem_ptr`.

Kernels take `SymmetricBuffer.addresses` (int64 `[world]`) and turn an entry into a pointer; they
never take `local` itself as a tensor argument. Triton's interpreter copies a tensor argument's
storage back after the launch, which would race with a peer process storing into it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SymmetricBuffer:
    """One symmetric allocation as one PE sees it.

    local:      uint8 `[nbytes]`, this PE's copy, for torch ops that read what peers stored.
    addresses:  int64 `[world]` on the kernels' device: the address of every PE's copy at which
                this PE's kernels can store into it (entry `rank` is `local`'s own).
    """

    local: torch.Tensor
    addresses: torch.Tensor
    rank: int

    @property
    def nbytes(self) -> int:
        return self.local.numel()

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This PE's copy of the region at byte `offset`, as a tensor of `shape` and `dtype`."""
        size = torch.Size(shape).numel() * dtype.itemsize
        if offset % dtype.itemsize or offset + size > self.nbytes:
            raise ValueError(f"region at byte {offset} of {size} bytes does not fit a {self.nbytes}-byte buffer")
        return self.local[offset : offset + size].view(dtype).view(shape)


class SymmetricHeap(ABC):
    """One PE's handle on a symmetric heap shared by `world_size` PEs."""

    name: str

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)

    @abstractmethod
    def allocate(self, nbytes: int) -> SymmetricBuffer:
        """A zero-filled buffer of `nbytes` on every PE. Collective: every PE of the heap calls it
        the same number of times, in the same order, with the same size."""
