"""The NVSHMEM layout, simulated with torch on 2, 4 and 8 gloo ranks, hands every expert exactly
the rows the `torch` backend does, in the same order (torch.equal), in both buffer modes.

Each world size is spawned once (module fixture) and runs every case; see `nvshmem_layout_cases`.
"""

from __future__ import annotations

import pytest
import torch
from dispatch_cases import Case
from nvshmem_layout_cases import run_cases
from ranks import run_ranks

from moeserve.dispatch.nvshmem_layout import MODES

TOKENS = (0, 1, 13, 40, 7, 3, 22, 5)


def cases_for(world_size: int) -> list[Case]:
    uneven = 7 if world_size < 8 else 12
    shapes = [
        (8, 1, "one_expert", "contiguous"),  # every pair to one expert
        (8, 2, "uniform", "contiguous"),
        (8, 2, "uniform", "round_robin"),
        (16, 8, "skewed", "contiguous"),
        (16, 8, "uniform", "round_robin"),
        (uneven, 3, "skewed", "round_robin"),
        (uneven, 3, "one_expert", "contiguous"),
    ]
    cases = []
    for num_experts, top_k, kind, placement in shapes:
        for dtype in (torch.float32, torch.bfloat16) if kind == "skewed" else (torch.float32,):
            i = len(cases)
            tokens = tuple(TOKENS[(r + i) % len(TOKENS)] for r in range(world_size))
            name = f"E{num_experts}-k{top_k}-{kind}-{placement}-{str(dtype)[6:]}-tokens{list(tokens)}"
            cases.append(Case(name, num_experts, top_k, kind, placement, tokens, dtype, seed=i))
    cases.append(Case("no-tokens-anywhere", 8, 2, "uniform", "contiguous", (0,) * world_size, torch.float32, seed=99))
    if world_size == 8:  # rank 7 holds no expert
        cases.append(Case("rank-without-experts", 7, 2, "skewed", "round_robin", TOKENS, torch.float32, seed=98))
    return cases


SLACK = 3  # max_tokens_per_rank above the largest rank's tokens: regions are never exactly full


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda n: f"ranks{n}")
def world(request: pytest.FixtureRequest) -> tuple[int, list[Case], list[list[dict]]]:
    world_size = request.param
    cases = cases_for(world_size)
    return world_size, cases, run_ranks(world_size, run_cases, cases, SLACK)


def test_layout_equals_torch_dispatch(world: tuple[int, list[Case], list[list[dict]]]) -> None:
    world_size, cases, results = world
    for c, case in enumerate(cases):
        total_pairs = sum(case.tokens_per_rank) * case.top_k
        for mode in MODES:
            received_everywhere = 0
            for rank in range(world_size):
                got = results[rank][c]
                sim = got[mode]
                where = f"{case.name}, {mode}, rank {rank}"
                assert sim["counts"] == got["torch_counts"], where
                assert sim["hidden"].dtype == got["torch_hidden"].dtype, where
                assert torch.equal(sim["hidden"], got["torch_hidden"]), where
                assert sim["max_writes"] <= 1, f"{where}: a buffer row written twice"
                assert sim["read_rows_written"], f"{where}: receive_order reads a row nobody wrote"
                assert sim["rows_written"] == sum(sim["counts"]), f"{where}: rows written but never read"
                assert sim["padded_counts_zero"], where
                received_everywhere += sim["rows_written"]
            assert received_everywhere == total_pairs, f"{case.name}, {mode}"
