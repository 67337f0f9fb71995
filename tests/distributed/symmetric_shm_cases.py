"""Per-rank body for `test_symmetric_shm`: ranks store into each other's shm copies from Triton kernels.

Each buffer holds one row of `ROW` int32 per PE, then one int64 signal word per PE. Every PE stores
its row into every peer's copy at row `rank` and raises its signal word there (release); then it
waits (acquire) for every peer's word in its own copy and reports what the copy holds.

One spawn of four ranks covers two heap sizes: a heap on the whole group (4 PEs) and one on the
pair of ranks {1, 3} (2 PEs, whose group rank 0 is not global rank 0). Spawning ranks costs seconds
each time; the kernels cost little.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

ROW = 8
PAIR = (1, 3)


def buffer_bytes(world_size: int) -> int:
    return world_size * ROW * 4 + world_size * 8


def expected_bytes(world_size: int, base: int) -> torch.Tensor:
    """What every PE's copy holds once all PEs have stored rows `base + 1000 * rank + column`."""
    rows = base + 1000 * torch.arange(world_size, dtype=torch.int32)[:, None] + torch.arange(ROW, dtype=torch.int32)
    signals = torch.ones(world_size, dtype=torch.int64)
    return torch.cat([rows.reshape(-1).view(torch.uint8), signals.view(torch.uint8)])


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The kernels, defined only once the rank body has chosen the interpreter."""
    import triton
    import triton.language as tl

    @triton.jit
    def put_row(addresses, rank, base, ROW: tl.constexpr, SIGNALS: tl.constexpr):
        peer = tl.program_id(0)
        copy = tl.load(addresses + peer)
        columns = tl.arange(0, ROW)
        tl.store(copy.to(tl.pointer_type(tl.int32)) + rank * ROW + columns, base + 1000 * rank + columns)
        tl.atomic_xchg((copy + SIGNALS).to(tl.pointer_type(tl.int64)) + rank, 1, sem="release", scope="sys")

    @triton.jit
    def wait_signal(addresses, rank, SIGNALS: tl.constexpr):
        signal = (tl.load(addresses + rank) + SIGNALS).to(tl.pointer_type(tl.int64)) + tl.program_id(0)
        raised = tl.atomic_add(signal, 0, sem="acquire", scope="sys")
        while raised == 0:
            raised = tl.atomic_add(signal, 0, sem="acquire", scope="sys")

    return put_row, wait_signal


def exchange(rank: int, world_size: int) -> dict[str, Any]:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from moeserve.dispatch.symmetric import SharedMemoryHeap

    pair = dist.new_group(list(PAIR))  # collective over every rank, members or not
    report = {"world": _exchange_on(None)}
    if rank in PAIR:
        report["pair"] = _exchange_on(pair)

    try:
        SharedMemoryHeap().allocate(0)
        report["zero_error"] = None
    except ValueError as error:
        report["zero_error"] = str(error)

    # Ranks on different machines cannot share memory: every rank must refuse, not only the odd one.
    with mock.patch("socket.gethostname", return_value="elsewhere") if rank == 1 else contextlib.nullcontext():
        try:
            SharedMemoryHeap()
            report["host_error"] = None
        except ValueError as error:
            report["host_error"] = str(error)
    return report


def _exchange_on(group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Three buffers, two from one heap and one from a second heap on the same group, each filled by every PE."""
    from moeserve.dispatch.symmetric import SharedMemoryHeap

    put_row, wait_signal = _kernels()
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    nbytes, signals = buffer_bytes(world_size), world_size * ROW * 4
    heap, other = SharedMemoryHeap(group), SharedMemoryHeap(group)
    buffers = {100: heap.allocate(nbytes), 200: heap.allocate(nbytes), 300: other.allocate(nbytes)}
    dist.barrier(group=group)  # every PE's allocate has returned, so every PE has unlinked its files
    leftover = sorted(f for f in os.listdir(heap.directory) if heap.session in f or other.session in f)

    for base, buffer in buffers.items():
        put_row[(world_size,)](buffer.addresses, rank, base, ROW=ROW, SIGNALS=signals)
    for buffer in buffers.values():
        wait_signal[(world_size,)](buffer.addresses, rank, SIGNALS=signals)
    return {
        "rank": rank,
        "world_size": world_size,
        "leftover": leftover,
        "sessions": (heap.session, other.session),
        "own_address": [int(b.addresses[rank]) == b.local.data_ptr() for b in buffers.values()],
        "spans": [(int(a), nbytes) for b in buffers.values() for a in b.addresses],
        "copies": {base: buffer.local.clone() for base, buffer in buffers.items()},
    }
