"""The `torch` backend equals `local` on random routings, for 2, 4 and 8 gloo ranks.

Each world size is spawned once (module fixture) and runs every case. Every rank has its own
tokens (different counts, some ranks none) and routing; the reference is `local` with every
expert on the concatenation of all ranks' tokens, rank 0's first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import Case, expert_major, make_experts, modes, placement_for, rank_inputs, run_cases, toy_experts
from ranks import run_ranks

from moeserve.dispatch import ExpertPlacement, create_dispatcher

TOKENS = (0, 1, 13, 40, 7, 3, 22, 5)  # rotated per case, so every rank sees 0 tokens in some case


def cases_for(world_size: int) -> list[Case]:
    """Every (experts, top-k) shape x routing x placement in float32; bfloat16 too where routing is
    skewed or experts do not split evenly over the ranks; and two edge cases."""
    uneven = 7 if world_size < 8 else 12  # 7 on 2 or 4 ranks, 12 on 8: some ranks hold one more
    cases = []
    for num_experts, top_k in ((8, 1), (8, 2), (8, 8), (16, 2), (16, 8), (uneven, 3)):
        for kind in ("uniform", "skewed", "one_expert"):
            for placement in ("contiguous", "round_robin"):
                bf16_too = kind == "skewed" or num_experts == uneven
                for dtype in (torch.float32, torch.bfloat16) if bf16_too else (torch.float32,):
                    i = len(cases)
                    tokens = tuple(TOKENS[(r + i) % len(TOKENS)] for r in range(world_size))
                    name = f"E{num_experts}-k{top_k}-{kind}-{placement}-{str(dtype)[6:]}-tokens{list(tokens)}"
                    cases.append(Case(name, num_experts, top_k, kind, placement, tokens, dtype, seed=i))
    cases.append(Case("no-tokens-anywhere", 8, 2, "uniform", "contiguous", (0,) * world_size, torch.float32, seed=99))
    if world_size == 8:  # 7 experts dealt round-robin over 8 ranks: rank 7 holds none
        cases.append(Case("rank-without-experts", 7, 2, "skewed", "round_robin", TOKENS, torch.float32, seed=98))
    return cases


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"ranks{n}")
def world(request: pytest.FixtureRequest) -> tuple[int, list[Case], list[dict]]:
    world_size = request.param
    cases = cases_for(world_size)
    return world_size, cases, run_ranks(world_size, run_cases, cases)


def reference(case: Case, world_size: int):
    """`local` on all ranks' tokens: its rows per expert and counts, combine() of the real and of the toy experts."""
    inputs = [rank_inputs(case, r) for r in range(world_size)]
    hidden, ids, weights = (torch.cat(parts) for parts in zip(*inputs))
    local = create_dispatcher("local", ExpertPlacement.contiguous(case.num_experts))
    received = local.dispatch(hidden, ids, weights)
    all_experts = tuple(range(case.num_experts))
    out = local.combine(make_experts(case, all_experts)(received), received.handle)
    toy_out = local.combine(toy_experts(case, received, all_experts), received.handle)
    return *expert_major(received), out, toy_out


@pytest.fixture
def one_thread():
    """The ranks' thread count for the reference (see `run_cases`), restored afterwards: CPU GEMMs
    round differently with another thread count, and the real experts' outputs then match exactly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_torch_equals_local(world: tuple[int, list[Case], list[dict]], one_thread: None) -> None:
    world_size, cases, results = world
    for c, case in enumerate(cases):
        ref_hidden, ref_counts, ref_out, ref_toy = reference(case, world_size)
        ref_rows = torch.split(ref_hidden, list(ref_counts))
        token_rows = torch.split(torch.arange(sum(case.tokens_per_rank)), list(case.tokens_per_rank))
        for rank in range(world_size):
            experts = placement_for(case, world_size, rank).local_experts
            for mode, bound in modes(case):
                got = results[rank]["cases"][c][mode]
                where = f"{case.name}, rank {rank}, {mode}"
                assert got["counts"] == tuple(ref_counts[e] for e in experts), where
                # the uneven mode hands on the counts it read; the low-latency one reads nothing
                assert got["syncs_host"] == (bound is None), where
                assert got["host_counts"] == (got["counts"] if bound is None else None), where
                if bound is not None:  # fixed-size regions: rows past the counts are padding
                    assert got["num_rows"] == world_size * bound * min(case.top_k, max_local(case, world_size)), where
                # each local expert receives exactly the rows `local` hands it, in the same order
                for e, rows in zip(experts, torch.split(got["received"], list(got["counts"]))):
                    assert torch.equal(rows, ref_rows[e]), f"{where}: rows of expert {e}"
                mine = token_rows[rank]
                assert torch.equal(got["toy_out"], ref_toy[mine]), f"{where}: combine order differs from local's"
                tol = 1e-6 if case.dtype == torch.float32 else 1e-2
                # real GEMMs: bit-equal too on this CPU at equal thread counts, but BLAS does not promise it
                torch.testing.assert_close(
                    got["out"], ref_out[mine], rtol=tol, atol=tol, msg=lambda m, where=where: f"{where}: {m}"
                )


def max_local(case: Case, world_size: int) -> int:
    return placement_for(case, world_size, 0).max_local_experts


def test_wrong_group_is_refused(world: tuple[int, list[Case], list[dict]]) -> None:
    world_size, _, results = world
    for rank in range(world_size):
        size_error, rank_error, subgroup_error = results[rank]["refusals"]
        assert f"ep_size={world_size + 1}" in size_error and f"group has {world_size}" in size_error
        assert f"rank {(rank + 1) % world_size}" in rank_error and f"rank {rank} of its group" in rank_error
        assert f"ep_size={world_size}" in subgroup_error and "group has 1" in subgroup_error


def test_needs_an_initialised_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(ValueError, match="not initialised"):
        create_dispatcher("torch", ExpertPlacement.contiguous(8, ep_size=2, rank=0))
