"""`shm` transport: rank processes on one CPU machine, each PE's copy a shared-memory file every rank maps.

A file on a memory-backed file system is the one object separate processes can all map. Each rank
creates its own copy as such a file, every rank maps every rank's, and the addresses a rank's
kernels store through are those of its own mappings: the same pages appear at a different address
in each process, so no process can use another's pointers.

Each rank unlinks its file once every rank has mapped it. The mappings keep the pages alive, and
nothing is left behind in the shared-memory directory if a process dies afterwards.
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeserve.dispatch.symmetric.heap import SymmetricBuffer, SymmetricHeap

_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SharedMemoryBuffer(SymmetricBuffer):
    """A symmetric buffer whose peers' copies are mappings this process holds.

    copies: every rank's copy as mapped here, by rank. `addresses` point into these mappings, so
            they must live as long as any kernel may use the addresses; holding them here ties
            their lifetime to the buffer's.
    """

    copies: tuple[torch.Tensor, ...]


class SharedMemoryHeap(SymmetricHeap):
    """One rank's handle on a heap shared by the ranks of a process group on one machine.

    Construction is collective over the group: it checks that the ranks share a machine and agrees
    on a session token, so that two heaps, or two jobs, never pick the same file names.
    """

    name = "shm"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group), torch.device("cpu"))
        self.group = group
        hosts: list[Any] = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            named = ", ".join(f"rank {r} on {host!r}" for r, host in enumerate(hosts))
            raise ValueError(f"the shm heap needs every rank on one machine, but the group spans several: {named}")
        # Rank 0 picks the directory too, so that every rank looks for its peers' files in the same place.
        session: list[Any] = [secrets.token_hex(8), shared_memory_dir()] if self.rank == 0 else [None, None]
        dist.broadcast_object_list(session, group=group, group_src=0)
        self.session, self.directory = session
        self._allocated = 0

    def path(self, index: int, rank: int) -> str:
        """Where `rank`'s copy of allocation `index` lives until every rank has mapped it."""
        return os.path.join(self.directory, f"moeserve-{self.session}-{index}-{rank}")

    def allocate(self, nbytes: int) -> SharedMemoryBuffer:
        if nbytes < 1:
            raise ValueError(f"a symmetric allocation needs at least one byte, got {nbytes}")
        index = self._allocated
        self._allocated += 1
        own = self.path(index, self.rank)
        try:
            _create_zeroed(own, nbytes)
            problem = None
        except OSError as error:
            problem = f"rank {self.rank} could not create {own}: {error}"
        try:
            # Doubles as the first barrier: past it every rank's file exists, or every rank raises.
            reports: list[Any] = [None] * self.world_size
            dist.all_gather_object(reports, (nbytes, problem), group=self.group)
            if any(p for _, p in reports):
                raise OSError("; ".join(p for _, p in reports if p))
            if len({size for size, _ in reports}) > 1:
                asked = ", ".join(f"rank {r}: {size}" for r, (size, _) in enumerate(reports))
                raise ValueError(f"symmetric allocation {index} asks for different sizes ({asked} bytes)")
            copies = tuple(_map(self.path(index, r), nbytes) for r in range(self.world_size))
            # Unlinking before a peer has opened the file would leave it nothing to map.
            dist.barrier(group=self.group)
        finally:
            if problem is None:
                os.unlink(own)
        addresses = torch.tensor([c.data_ptr() for c in copies], dtype=torch.int64)
        return SharedMemoryBuffer(local=copies[self.rank], addresses=addresses, rank=self.rank, copies=copies)


def shared_memory_dir() -> str:
    """A directory whose files live in memory where the system has one, else the temp dir (still
    shared between processes, only slower, as its pages may be written back to disk)."""
    if os.path.isdir(_SHM_DIR) and os.access(_SHM_DIR, os.W_OK | os.X_OK):
        return _SHM_DIR
    return tempfile.gettempdir()


def _create_zeroed(path: str, nbytes: int) -> None:
    """Create `path` as a new file of `nbytes` zeros, its pages reserved now where the system can:
    a memory file system short of room then fails here, not with SIGBUS at a kernel's first store."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _map(path: str, nbytes: int) -> torch.Tensor:
    """Map a peer's file, which must already be whole: `torch.from_file` would quietly create a missing
    file and grow a short one, leaving this rank storing into memory no peer ever reads."""
    size = os.stat(path).st_size
    if size != nbytes:
        raise ValueError(f"{path} holds {size} bytes where {nbytes} were allocated")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
