"""`nvshmem` transport started by nvshmem4py: NVSHMEM's own Python bindings own NVSHMEM's life.

PyTorch's symmetric memory (`nvshmem_heap`) starts NVSHMEM inside its first allocation, from its
own bootstrap, and exposes only what its collectives need: a buffer, the peers' mapped addresses
and its private `_nvshmemx_cumodule_init`. nvshmem4py is the interface NVIDIA maintains for
NVSHMEM's host API, and it is what the kernels' side needs and PyTorch's does not offer:

* the bootstrap is explicit: rank 0 makes a unique id (`get_unique_id`), torch.distributed
  carries it to every rank (`broadcast_object_list` over the engine's group, which exists
  already, so NVSHMEM needs no launcher, MPI or store of its own), and every rank calls
  `init(..., initializer_method="uid")` with its group rank as PE: PE numbers are ranks by
  construction, which the put variants' `pe` arguments rely on;
* PE and team queries (`my_pe`, `n_pes`, the node and load/store-shared teams) say what the
  machine is: which peers NVSHMEM reaches by load/store (`nvshmem_ptr`, the address table's
  entries) and which only by the network;
* `cumodule_init` initialises NVSHMEM's device state in each CUDA module that links its device
  library (a Triton kernel's module: `nvshmem_device.init_linked_modules`), from the same
  NVSHMEM instance that made the heap.

Only one of the two may start NVSHMEM in a process: a heap of either kind is the only one the
dispatcher builds (`NvshmemDispatcher(..., nvshmem_host=...)`, `choose_nvshmem_host`).

The calls go through `NvshmemHost`, a small interface: `Nvshmem4pyHost` makes them with
nvshmem4py (`Nvshmem4pyHeap.make_host`), and a CPU test fakes it to run the unique-id exchange
over a real gloo group and the heap's address table.
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from moeserve.dispatch.symmetric.nvshmem_heap import NvshmemHeapBase

NVSHMEM_HOSTS = ("auto", "nvshmem4py", "torch")
NvshmemHostChoice = Literal["auto", "nvshmem4py", "torch"]
Team = Literal["node", "shared"]  # the PEs of this node; the PEs this one reaches by load/store


class NvshmemHost(Protocol):
    """NVSHMEM's host calls the heap makes (nvshmem4py's, or a test's fake)."""

    def unique_id(self) -> bytes:
        """A new unique id for a uid bootstrap, as bytes (made on one rank only)."""

    def init(self, device_index: int, unique_id: bytes, rank: int, nranks: int) -> None:
        """Start NVSHMEM on this process's GPU as PE `rank` of `nranks`, all sharing `unique_id`."""

    def my_pe(self) -> int: ...

    def n_pes(self) -> int: ...

    def team_n_pes(self, team: Team) -> int: ...

    def symmetric_bytes(self, nbytes: int) -> torch.Tensor:
        """uint8 `[nbytes]` on the symmetric heap (collective, as every symmetric allocation)."""

    def peer_address(self, address: int, pe: int) -> int:
        """Where this PE loads and stores `pe`'s copy of the symmetric `address` (0: only by puts)."""

    def init_module(self, handle: int) -> None:
        """NVSHMEM's device state in the CUDA module `handle`."""


def nvshmem4py_importable() -> bool:
    return importlib.util.find_spec("nvshmem") is not None and importlib.util.find_spec("nvshmem.core") is not None


def choose_nvshmem_host(choice: NvshmemHostChoice, device: torch.device) -> Literal["nvshmem4py", "torch"]:
    """Who starts NVSHMEM on `device`: nvshmem4py where it is importable and the device is a GPU
    (auto), or as asked. Asked for and not importable: a ValueError that says how to get it."""
    if choice not in NVSHMEM_HOSTS:
        raise ValueError(f"nvshmem_host {choice!r} is not one of {', '.join(NVSHMEM_HOSTS)}")
    if choice == "nvshmem4py" and not nvshmem4py_importable():
        raise ValueError(
            "nvshmem_host='nvshmem4py' but nvshmem4py is not installed: install nvshmem4py-cu13 (or -cu12, "
            "matching torch's CUDA), or choose nvshmem_host='torch' (PyTorch's symmetric memory starts NVSHMEM)"
        )
    if choice == "nvshmem4py" and device.type != "cuda":
        raise ValueError(f"nvshmem_host='nvshmem4py' starts NVSHMEM on a GPU; this dispatcher runs on {device}")
    if choice == "auto":
        return "nvshmem4py" if device.type == "cuda" and nvshmem4py_importable() else "torch"
    return choice


def bootstrap(host: NvshmemHost, group: dist.ProcessGroup, device_index: int) -> None:
    """NVSHMEM started on every rank of `group` from one unique id, PE = group rank.

    Rank 0 makes the id; `broadcast_object_list` carries it (on NCCL through the GPU, which is why
    the device is named). Collective over `group`."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    carried: list[bytes | None] = [host.unique_id() if rank == 0 else None]
    on_gpu = dist.get_backend(group) == dist.Backend.NCCL
    dist.broadcast_object_list(
        carried,
        src=dist.get_global_rank(group, 0),
        group=group,
        device=torch.device("cuda", device_index) if on_gpu else None,
    )
    unique_id = carried[0]
    if not isinstance(unique_id, bytes) or not unique_id:
        raise RuntimeError(f"rank {rank}: rank 0 sent no NVSHMEM unique id (got {type(unique_id).__name__})")
    host.init(device_index, unique_id, rank, world)
    if (host.my_pe(), host.n_pes()) != (rank, world):
        pe = f"PE {host.my_pe()} of {host.n_pes()}"
        raise RuntimeError(f"NVSHMEM made rank {rank} of {world} {pe}: the PEs must be the group's ranks")


class Nvshmem4pyHeap(NvshmemHeapBase):
    """NVSHMEM's symmetric heap, NVSHMEM started by nvshmem4py over the group (module docstring)."""

    def _start(self) -> None:
        self._host = self.make_host()
        bootstrap(self._host, self._group, self.device.index if self.device.index is not None else 0)
        # What NVSHMEM found: the node's PEs, and those reachable by load/store (NVLink, P2P).
        self.teams = {team: self._host.team_n_pes(team) for team in ("node", "shared")}

    def make_host(self) -> NvshmemHost:
        """The NVSHMEM calls this heap makes: nvshmem4py's (a test's subclass fakes them)."""
        return Nvshmem4pyHost()

    def _symmetric(self, nbytes: int) -> tuple[torch.Tensor, list[int], object]:
        local = self._host.symmetric_bytes(nbytes)
        local.zero_()  # queued on the current stream: done only once the base's barrier returns
        own = local.data_ptr()
        return local, [self._host.peer_address(own, pe) for pe in range(self.world_size)], local

    def init_module(self, handle: int) -> None:
        self._host.init_module(handle)


class Nvshmem4pyHost:
    """`NvshmemHost` by nvshmem4py (`nvshmem.core` and its `bindings`). GPU only."""

    def __init__(self) -> None:
        import nvshmem.bindings
        import nvshmem.core

        self._core, self._bindings = nvshmem.core, nvshmem.bindings

    def unique_id(self) -> bytes:
        uid = self._core.get_unique_id()
        return ctypes.string_at(uid.ptr, uid._data.nbytes)

    def init(self, device_index: int, unique_id: bytes, rank: int, nranks: int) -> None:
        from cuda.core import Device

        uid = self._core.get_unique_id(empty=True)
        if len(unique_id) != uid._data.nbytes:
            raise ValueError(f"an NVSHMEM unique id is {uid._data.nbytes} bytes; rank 0 sent {len(unique_id)}")
        ctypes.memmove(uid.ptr, unique_id, len(unique_id))
        device = Device(device_index)
        device.set_current()
        self._core.init(device=device, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")

    def my_pe(self) -> int:
        return self._core.my_pe()

    def n_pes(self) -> int:
        return self._core.n_pes()

    def team_n_pes(self, team: Team) -> int:
        teams = {"node": self._core.Teams.TEAM_NODE, "shared": self._core.Teams.TEAM_SHARED}
        return self._core.team_n_pes(teams[team])

    def symmetric_bytes(self, nbytes: int) -> torch.Tensor:
        return self._core.bytetensor((nbytes,), dtype=torch.uint8)

    def peer_address(self, address: int, pe: int) -> int:
        return int(self._bindings.ptr(address, pe))

    def init_module(self, handle: int) -> None:
        status = self._bindings.cumodule_init(handle)
        if status:
            raise RuntimeError(f"nvshmemx_cumodule_init failed ({status}) for CUDA module {handle:#x}")
