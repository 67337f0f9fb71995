"""`nvshmem` transport: GPU buffers from PyTorch's symmetric memory, peers reached over NVLink.

PyTorch's symmetric memory allocates from the NVSHMEM symmetric heap when its NVSHMEM backend is
available (`set_backend("NVSHMEM")`) and from CUDA-IPC-mapped memory otherwise; either way its
rendezvous hands back every peer's buffer address as mapped into this process, which is exactly
the table the kernels take for the peers of this rank's NVLink domain. Peers on other nodes have
no such address (PyTorch reports 0) and are reached by the kernels' NVSHMEM puts over IBGDA, which
address them by PE and symmetric offset: their entries are never read. A peer inside the domain
without an address is refused (the domain is wrong for this machine).

A heap is built with the buffers it will hold, so that NVSHMEM's heap is sized for them before
NVSHMEM starts (`nvshmem_heap_size`), and hands a buffer out only once every rank's zero-fill has
completed (a device synchronize, then the group's barrier).

Runs only on GPUs; none was lent while this was written, so it is checked by the `gpu`-marked
tests and `bench/dispatch.py`, not by CI.
"""

from __future__ import annotations

import importlib.util
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from moeserve.dispatch.symmetric.heap import SymmetricBuffer, SymmetricHeap
from moeserve.dispatch.symmetric.nvshmem_heap_size import SYMMETRIC_SIZE_VAR, heap_size_to_export, required_heap_bytes


def nvshmem_heap_unavailable(device: torch.device) -> str | None:
    """None if this process can build an `NvshmemHeap` on `device`, else why not."""
    if not torch.cuda.is_available():
        return f"it needs a CUDA device (got {device}; torch.cuda.is_available() is False)"
    if not dist.is_available() or not dist.is_initialized():
        return "it needs an initialised torch.distributed group of the ranks"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "this torch build has no symmetric memory (torch.distributed._symmetric_memory)"
    return None


def size_nvshmem_heap(planned_bytes: Sequence[int], device: torch.device) -> None:
    """Export `NVSHMEM_SYMMETRIC_SIZE` for `planned_bytes`, or refuse (`nvshmem_heap_size`).

    NVSHMEM reads the variable once, in PyTorch's first symmetric-memory allocation of the process,
    so this must run before it: the dispatcher's heap is built at startup, before any such
    allocation (nothing else in moeserve allocates symmetric memory). A later heap in the same
    process is checked against the size then in effect, the variable's value; buffers an earlier
    heap still holds are not counted against it."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    value = heap_size_to_export(required_heap_bytes(planned_bytes), os.environ.get(SYMMETRIC_SIZE_VAR), free_bytes)
    if value is not None:
        os.environ[SYMMETRIC_SIZE_VAR] = str(value)


class NvshmemHeapBase(SymmetricHeap, ABC):
    """NVSHMEM's symmetric heap, whoever started NVSHMEM (PyTorch here, nvshmem4py in
    `nvshmem4py_heap`): the sizing before it starts, the domain's addresses checked, and a buffer
    handed out only once every rank's zero-fill has run."""

    name = "nvshmem"

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        planned_bytes: Sequence[int],
        nvlink_domain_size: int | None = None,
    ) -> None:
        """planned_bytes: the buffers this heap will hold at once. NVSHMEM's heap is sized for them
        here, before this heap allocates anything (see `size_nvshmem_heap`). nvlink_domain_size:
        consecutive ranks that must have each other's addresses (None: the whole group; 0: none,
        every peer is reached by puts)."""
        self._group = group or dist.group.WORLD
        super().__init__(dist.get_rank(self._group), dist.get_world_size(self._group), device)
        size_nvshmem_heap(planned_bytes, self.device)
        self._domain = self.world_size if nvlink_domain_size is None else nvlink_domain_size
        self._kept: list[object] = []  # what keeps each buffer mapped, as long as the heap lives
        self._start()

    @abstractmethod
    def _start(self) -> None:
        """Whatever must happen once NVSHMEM's heap size is exported, before the first buffer."""

    def allocate(self, nbytes: int) -> SymmetricBuffer:
        if nbytes < 1:
            raise ValueError(f"a symmetric buffer needs at least one byte, got {nbytes}")
        local, addresses, keep = self._symmetric(nbytes)
        check_load_store_peers(addresses, self.rank, self._domain)
        self._kept.append(keep)
        zeroed_everywhere(self._group, self.device)
        return SymmetricBuffer(
            local=local, addresses=torch.tensor(addresses, dtype=torch.int64, device=self.device), rank=self.rank
        )

    @abstractmethod
    def _symmetric(self, nbytes: int) -> tuple[torch.Tensor, list[int], object]:
        """A new buffer's local copy (its zero-fill queued), every PE's load/store address of it
        (0: none) and what must live as long as the heap for it to stay mapped. Collective."""

    @abstractmethod
    def init_module(self, handle: int) -> None:
        """NVSHMEM's device state in the CUDA module `handle`, from the NVSHMEM that made this heap."""


class NvshmemHeap(NvshmemHeapBase):
    """NVSHMEM started by PyTorch's symmetric memory (its NVSHMEM backend), in its first allocation."""

    def _start(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if symm_mem.is_nvshmem_available():
            symm_mem.set_backend("NVSHMEM")
        self._symm_mem = symm_mem

    def _symmetric(self, nbytes: int) -> tuple[torch.Tensor, list[int], object]:
        local = self._symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        local.zero_()  # queued on the current stream: done only once `zeroed_everywhere` returns
        handle = self._symm_mem.rendezvous(local, group=self._group)
        return local, list(handle.buffer_ptrs), handle

    def init_module(self, handle: int) -> None:
        from torch._C._distributed_c10d import _nvshmemx_cumodule_init

        _nvshmemx_cumodule_init(handle)


def check_load_store_peers(addresses: Sequence[int], rank: int, domain: int) -> None:
    """Refuse a domain (of `domain` consecutive ranks; 0: none) in which a peer of `rank` has no
    load/store address (0 in `addresses`): the domain is wrong for this machine."""
    first = rank // domain * domain if domain else rank
    unreachable = [peer for peer in range(first, first + domain) if addresses[peer] == 0]
    if unreachable:
        raise ValueError(
            f"ranks {unreachable} of rank {rank}'s NVLink domain ({domain} ranks) have no load/store "
            "address: set --nvlink-domain-size to the ranks that share NVLink (the rest are reached by puts)"
        )


def zeroed_everywhere(group: dist.ProcessGroup, device: torch.device) -> None:
    """Return once every rank's zero-fill of a new buffer has run, so that no peer's store can land
    before it and be wiped. The fill is only queued on this rank's stream, so the host waits for
    the device first, then for every rank to get that far. A symmetric-memory handle's own
    `barrier()` would not do: in the PyTorch sources read while writing this
    (NVSHMEMSymmetricMemory), the NVSHMEM backend's barrier is an empty TODO. The group's barrier
    is used instead (on NCCL the host blocks until it completes)."""
    torch.cuda.synchronize(device)
    if dist.get_backend(group) == dist.Backend.NCCL:
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)
