"""What `NvshmemHeap` does around PyTorch's symmetric memory, in order, with that memory stood in
for on CPU (the real one needs GPUs): NVSHMEM's heap size is exported before the first
allocation, where NVSHMEM reads it, and a buffer is handed out only after this rank's zero-fill
has run on the device and every rank has passed the group's barrier (the handle's own barrier is
an empty TODO in PyTorch's NVSHMEM backend, so it is not relied on)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from moeserve.dispatch.symmetric.nvshmem_heap import NvshmemHeap
from moeserve.dispatch.symmetric.nvshmem_heap_size import SYMMETRIC_SIZE_VAR, required_heap_bytes

PLANNED = [1536 << 20]  # past NVSHMEM's 1 GiB default, so a size must be exported


@pytest.fixture
def one_rank_group():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_heap_is_sized_first_and_a_buffer_waits_for_every_rank(one_rank_group, monkeypatch) -> None:
    monkeypatch.delenv(SYMMETRIC_SIZE_VAR, raising=False)
    events: list[tuple] = []

    def empty(nbytes, dtype, device):
        events.append(("allocate", os.environ.get(SYMMETRIC_SIZE_VAR)))
        return torch.full((nbytes,), 0xFF, dtype=dtype)  # what freshly allocated memory may hold

    def rendezvous(local, group):
        events.append(("rendezvous",))
        return SimpleNamespace(buffer_ptrs=[local.data_ptr()], barrier=lambda: events.append(("handle barrier",)))

    def synchronize(device):
        events.append(("synchronize",))

    def barrier(group=None, **_):
        events.append(("barrier",))

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: False)
    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", rendezvous)

    heap = NvshmemHeap(None, torch.device("cpu"), PLANNED)
    buffer = heap.allocate(4096)

    assert events == [("allocate", str(required_heap_bytes(PLANNED))), ("rendezvous",), ("synchronize",), ("barrier",)]
    assert not buffer.local.any()
    assert buffer.addresses.tolist() == [buffer.local.data_ptr()]
