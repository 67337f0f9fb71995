"""The `nvshmem` backend (device-initiated stores into peers' symmetric buffers) equals `local`,
and so the `torch` backend, bit for bit: with emulated PEs in one process (2, 4 and 8) and with
shared-memory rank processes (2 and 4), in both modes, on CPU under Triton's interpreter.

The interpreter runs one program after another, so each world takes its own spread of the cases:
together they hold every shape, routing kind, placement and dtype, and the edge cases (no tokens
anywhere; at 8 ranks, a rank without experts).

Two chunk sizes: 64 tokens, so the bounded modes of every case run low-latency (one chunk, padded
output, no host read), and 16, so every mode runs high-throughput in up to three chunks through
the two ring slots (the credits between slot reuses included).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from dispatch_cases import Case, assert_matches_local, case_steps, placement_for, run_cases
from ranks import run_ranks
from test_torch_dispatcher import cases_for

from moeserve.dispatch import DispatchRows, ExpertPlacement
from moeserve.dispatch.nvshmem import ALL_PUTS, NvshmemDispatcher, check_domain
from moeserve.dispatch.symmetric import EmulatedWorld, run_lockstep

CHUNKS = {"low_latency": 64, "chunked": 16}


def every(cases: list[Case], step: int, first: int = 0) -> list[Case]:
    """Every step-th case from `first`: a spread of the cases for one world."""
    return cases[first::step]


def emulated_results(
    world_size: int, cases: list[Case], chunk_tokens: int, dispatch_fp8: bool = False, domain: int | None = None
) -> list[dict]:
    """Per rank, like `run_cases`: every case through N emulated PEs in lockstep; `domain`: the
    NVLink domain's size, the other PEs reached by (emulated) puts."""
    per_rank: list[dict] = [{"cases": []} for _ in range(world_size)]
    for case in cases:
        world = EmulatedWorld(world_size)
        dispatchers = [
            NvshmemDispatcher(
                placement_for(case, world_size, r),
                DispatchRows(case.hidden_size, case.top_k, case.dtype),
                heap=world.heaps[r],
                chunk_tokens=chunk_tokens,
                dispatch_fp8=dispatch_fp8,
                nvlink_domain_size=domain,
            )
            for r in range(world_size)
        ]
        steps = [case_steps(d, case, r, world_size) for r, d in enumerate(dispatchers)]
        for rank, result in enumerate(run_lockstep(steps)):
            per_rank[rank]["cases"].append(result)
    return per_rank


@pytest.mark.parametrize(
    "world_size,chunk,step,first",
    [(2, "low_latency", 6, 0), (8, "low_latency", 48, 5), (2, "chunked", 8, 3), (4, "chunked", 13, 0)],
)
def test_emulated_pes_equal_local(world_size: int, chunk: str, step: int, first: int, one_thread: None) -> None:
    cases = every(cases_for(world_size), step, first)
    results = emulated_results(world_size, cases, CHUNKS[chunk])
    assert_matches_local(world_size, cases, results, CHUNKS[chunk])


@pytest.mark.parametrize(
    "world_size,domain,chunk,step,first",
    [(4, 2, "low_latency", 13, 1), (4, 2, "chunked", 26, 2), (2, 1, "chunked", 16, 5), (8, 4, "low_latency", 48, 3)],
    ids=["ep4-nodes2-low_latency", "ep4-nodes2-chunked", "ep2-nodes2-chunked", "ep8-nodes2-low_latency"],
)
def test_puts_between_emulated_nodes_equal_local(
    world_size: int, domain: int, chunk: str, step: int, first: int, one_thread: None
) -> None:
    """PEs outside a rank's NVLink domain reached by the put variants (emulated: staged rows, then
    data before signal), the rest by stores, in one group: the same rows and results as `local`."""
    cases = every(cases_for(world_size), step, first)
    results = emulated_results(world_size, cases, CHUNKS[chunk], domain=domain)
    assert_matches_local(world_size, cases, results, CHUNKS[chunk])


@pytest.mark.parametrize(
    "world_size,chunk,step,first",
    [(1, "low_latency", 6, 1), (1, "chunked", 6, 4), (4, "low_latency", 26, 3), (4, "chunked", 26, 4)],
    ids=["ep1-low_latency", "ep1-chunked", "ep4-low_latency", "ep4-chunked"],
)
def test_every_peer_by_puts_equals_local(world_size: int, chunk: str, step: int, first: int, one_thread: None) -> None:
    """`nvlink_domain_size=0`: no peer is stored into, not even the rank itself; every send is the
    (emulated) put launch, so one PE puts to itself, as one GPU does through NVSHMEM in the GPU
    runbook. The same rows and results as `local`."""
    cases = every(cases_for(max(world_size, 2)), step, first)
    if world_size == 1:  # the two-rank cases' shapes and routings, all of their tokens on one PE
        cases = [replace(c, tokens_per_rank=c.tokens_per_rank[:1]) for c in cases]
    results = emulated_results(world_size, cases, CHUNKS[chunk], domain=ALL_PUTS)
    assert_matches_local(world_size, cases, results, CHUNKS[chunk])


def test_a_domain_must_tile_the_group() -> None:
    assert (check_domain(None, 4), check_domain(2, 4), check_domain(8, 4), check_domain(ALL_PUTS, 4)) == (4, 2, 4, 0)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="nvlink_domain_size"):
            check_domain(bad, 4)


def test_every_peer_by_puts_launches_only_the_put_variant() -> None:
    """At `ALL_PUTS` each send is one launch of the put kind, the store launch (which would find no
    group of its own) left out; a domain of its own rank stores to itself and puts to the rest."""
    rows = DispatchRows(8, 2, torch.float32)
    heaps = EmulatedWorld(2).heaps
    kinds = [
        NvshmemDispatcher(ExpertPlacement.contiguous(4, 2, 0), rows, heap=heaps[0], nvlink_domain_size=d)._send_kinds
        for d in (ALL_PUTS, 1)
    ]
    assert [[kind for kind, _ in k] for k in kinds] == [[1], [0, 1]]


@pytest.mark.parametrize("world_size,step", [(2, 8), (4, 26)], ids=["ranks2", "ranks4"])
def test_shared_memory_ranks_equal_torch(world_size: int, step: int, one_thread: None) -> None:
    """Rank processes mapping each other's buffers from shared memory, beside the `torch` backend
    in the same processes: both equal `local`, and each other bit for bit."""
    cases = every(cases_for(world_size), step)
    nvshmem = run_ranks(world_size, run_cases, cases, "nvshmem", {"chunk_tokens": CHUNKS["low_latency"]}, timeout=300)
    assert_matches_local(world_size, cases, nvshmem, CHUNKS["low_latency"])
    torch_results = run_ranks(world_size, run_cases, cases, "torch")
    for rank in range(world_size):
        for c, case in enumerate(cases):
            for mode, got in nvshmem[rank]["cases"][c].items():
                want = torch_results[rank]["cases"][c][mode]
                for key in ("received", "out", "toy_out"):
                    assert torch.equal(got[key], want[key]), f"{case.name}, rank {rank}, {mode}: {key}"


def test_rows_to_other_nodes_go_through_the_staging_region(one_thread: None) -> None:
    """Two PEs in two domains: each one's rows for the other are staged in its own buffer (the
    put's source) and reach the peer's slot from there; rows for itself are stored directly, so
    its staging region for itself stays empty."""
    case = next(c for c in cases_for(2) if c.kind == "uniform" and c.top_k > 1 and min(c.tokens_per_rank) >= 5)
    world = EmulatedWorld(2)
    dispatchers = [
        NvshmemDispatcher(
            placement_for(case, 2, r),
            DispatchRows(case.hidden_size, case.top_k, case.dtype),
            heap=world.heaps[r],
            chunk_tokens=CHUNKS["low_latency"],
            nvlink_domain_size=1,
        )
        for r in range(2)
    ]
    results = run_lockstep([case_steps(d, case, r, 2) for r, d in enumerate(dispatchers)])
    assert_matches_local(2, [case], [{"cases": [r]} for r in results], CHUNKS["low_latency"])
    for rank, d in enumerate(dispatchers):
        layout = d._layout
        stage = d._buffer.view(
            layout.offsets["dispatch_stage"],
            (layout.slots, layout.local_experts, layout.ep, layout.chunk_tokens * layout.row_bytes),
            torch.uint8,
        )
        assert stage[:, :, 1 - rank].any(), f"rank {rank} staged nothing for its peer"
        assert not stage[:, :, rank].any(), f"rank {rank} staged rows for itself"
