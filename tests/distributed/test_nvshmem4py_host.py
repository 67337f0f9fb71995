"""NVSHMEM started by nvshmem4py (`nvshmem4py_heap`): the unique-id bootstrap over a real gloo
group with nvshmem4py's calls faked behind `NvshmemHost`, the heap's buffers and address table,
who starts NVSHMEM (`choose_nvshmem_host`), and, on a GPU with nvshmem4py, the put path bit-equal
to `local` on a heap nvshmem4py made."""

from __future__ import annotations

import datetime
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from moeserve.dispatch.symmetric import nvshmem4py_heap, nvshmem_heap
from moeserve.dispatch.symmetric.nvshmem4py_heap import Nvshmem4pyHeap, bootstrap, choose_nvshmem_host

ROOT = Path(__file__).resolve().parents[2]


class FakeHost:
    """nvshmem4py's calls as a test sees them: the ids it made, what init got, tensors for buffers,
    and peers with load/store addresses only inside `shared` consecutive PEs."""

    def __init__(self, shared: int = 1, pe_offset: int = 0) -> None:
        self.made: list[bytes] = []
        self.started: tuple | None = None
        self.shared, self.pe_offset = shared, pe_offset

    def unique_id(self) -> bytes:
        self.made.append(f"nvshmem-uid-{len(self.made)}".encode() * 4)
        return self.made[-1]

    def init(self, device_index: int, unique_id: bytes, rank: int, nranks: int) -> None:
        self.started = (device_index, unique_id, rank, nranks)

    def my_pe(self) -> int:
        return self.started[2] + self.pe_offset

    def n_pes(self) -> int:
        return self.started[3]

    def team_n_pes(self, team: str) -> int:
        return {"node": self.started[3], "shared": self.shared}[team]

    def symmetric_bytes(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 7, dtype=torch.uint8)

    def peer_address(self, address: int, pe: int) -> int:
        me = self.my_pe()
        return address + (pe - me) * 4096 if pe // self.shared == me // self.shared else 0

    def init_module(self, handle: int) -> None:
        raise AssertionError("no kernel module on CPU")


def exchange(rank: int, world_size: int) -> dict:
    """One rank's bootstrap with a fake host over the default (gloo) group."""
    host = FakeHost()
    bootstrap(host, dist.group.WORLD, device_index=rank)
    return {"made": host.made, "started": host.started}


def test_rank_0s_unique_id_reaches_every_rank_over_gloo(one_thread: None) -> None:
    """Only rank 0 makes an id; every rank starts NVSHMEM with that id, as PE = its rank of 3."""
    results = run_ranks(3, exchange)
    made = results[0]["made"]
    assert len(made) == 1 and all(not r["made"] for r in results[1:])
    assert [r["started"] for r in results] == [(rank, made[0], rank, 3) for rank in range(3)]


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process (the heap's collectives run on it)."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_pe_that_is_not_the_rank_is_refused(world_of_one) -> None:
    with pytest.raises(RuntimeError, match="rank 0 of 1 PE 1 of 1: the PEs must be the group's ranks"):
        bootstrap(FakeHost(pe_offset=1), world_of_one, device_index=0)


def test_the_heap_hands_out_zeroed_buffers_and_the_address_table(world_of_one, monkeypatch) -> None:
    """The buffer comes zeroed from NVSHMEM's heap (the fake's is full of 7s); the table holds
    `nvshmem_ptr`'s addresses; a domain that needs an address NVSHMEM has not got is refused,
    one of no load/store peer (0) needs none. NVSHMEM's heap sizing and the device barrier are
    the GPU's (and shared with PyTorch's heap), so they are stubbed."""
    sized = []
    monkeypatch.setattr(nvshmem_heap, "size_nvshmem_heap", lambda planned, device: sized.append(list(planned)))
    monkeypatch.setattr(nvshmem_heap, "zeroed_everywhere", lambda group, device: None)

    class FakeHeap(Nvshmem4pyHeap):
        def make_host(self) -> FakeHost:
            return FakeHost()

    heap = FakeHeap(world_of_one, torch.device("cpu"), [100, 200], nvlink_domain_size=0)
    assert sized == [[100, 200]] and heap.teams == {"node": 1, "shared": 1}
    buffer = heap.allocate(100)
    assert not buffer.local.any() and buffer.addresses.tolist() == [buffer.local.data_ptr()]
    with pytest.raises(ValueError, match="a symmetric buffer needs at least one byte"):
        heap.allocate(0)

    class Unmapped(FakeHost):
        def peer_address(self, address: int, pe: int) -> int:
            return 0

    class UnmappedHeap(Nvshmem4pyHeap):
        def make_host(self) -> FakeHost:
            return Unmapped()

    refusing = UnmappedHeap(world_of_one, torch.device("cpu"), [100], nvlink_domain_size=1)
    with pytest.raises(ValueError, match=r"ranks \[0\] of rank 0's NVLink domain \(1 ranks\) have no load/store"):
        refusing.allocate(100)


def test_nvshmem4py_starts_nvshmem_where_it_can(monkeypatch) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(nvshmem4py_heap, "nvshmem4py_importable", lambda: True)
    assert [choose_nvshmem_host("auto", d) for d in (cuda, cpu)] == ["nvshmem4py", "torch"]
    assert choose_nvshmem_host("torch", cuda) == "torch" and choose_nvshmem_host("nvshmem4py", cuda) == "nvshmem4py"
    monkeypatch.setattr(nvshmem4py_heap, "nvshmem4py_importable", lambda: False)
    assert choose_nvshmem_host("auto", cuda) == "torch"
    with pytest.raises(ValueError, match="nvshmem_host='nvshmem4py' but nvshmem4py is not installed"):
        choose_nvshmem_host("nvshmem4py", cuda)
    with pytest.raises(ValueError, match="nvshmem_host 'mpi' is not one of auto, nvshmem4py, torch"):
        choose_nvshmem_host("mpi", cuda)
    monkeypatch.setattr(nvshmem4py_heap, "nvshmem4py_importable", lambda: True)
    with pytest.raises(ValueError, match="starts NVSHMEM on a GPU; this dispatcher runs on cpu"):
        choose_nvshmem_host("nvshmem4py", cpu)


def test_asking_for_nvshmem4py_without_it_fails_when_the_dispatcher_is_built(monkeypatch) -> None:
    """The engine option reaches the dispatcher's heap: asked for and not installed, the build fails
    saying what to install; a value that is no choice fails where the option is read."""
    from moeserve.dispatch import DispatchRows, ExpertPlacement, ep_dispatcher
    from moeserve.engine_config import ParallelConfig

    monkeypatch.setattr(nvshmem4py_heap, "nvshmem4py_importable", lambda: False)
    parallel = ParallelConfig(a2a_backend="nvshmem", nvshmem_host="nvshmem4py")
    rows = DispatchRows(8, 2, torch.float32)
    with pytest.raises(ValueError, match="nvshmem4py is not installed: install nvshmem4py-cu13"):
        ep_dispatcher(parallel, ExpertPlacement.contiguous(4), "cpu", None, rows)
    assert ep_dispatcher(ParallelConfig(a2a_backend="nvshmem"), ExpertPlacement.contiguous(4), "cpu", None, rows)
    with pytest.raises(ValueError, match="nvshmem_host 'mpi' is not one of auto, nvshmem4py, torch"):
        ParallelConfig(nvshmem_host="mpi")


@pytest.mark.gpu
def test_every_put_through_nvshmem4py_matches_local(world_of_one) -> None:
    """One GPU, NVSHMEM started by nvshmem4py: every row, signal and credit an NVSHMEM put to
    itself (`nvlink_domain_size=0`), bit-equal to `local` in both modes."""
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    from moeserve.dispatch.nvshmem import ALL_PUTS, CHUNK_TOKENS

    sys.path.insert(0, str(ROOT / "bench"))
    check = importlib.import_module("dispatch_check")
    device = torch.device("cuda", 0)
    runs = [(case, *mode) for case in check.symmetric_memory_cases() for mode in case.modes(1, CHUNK_TOKENS)]
    sizes = [check.case_layout(case, 1, CHUNK_TOKENS, staged=True).nbytes for case, *_ in runs]
    heap = Nvshmem4pyHeap(world_of_one, device, sizes, nvlink_domain_size=ALL_PUTS)
    for case, mode, bound in runs:
        record = check.check_pe(case, 1, 0, mode, bound, heap, device, CHUNK_TOKENS, ALL_PUTS)
        assert record["passed"], (case.name, mode, record["problems"])
