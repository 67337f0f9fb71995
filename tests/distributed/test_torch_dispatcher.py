"""The `torch` backend equals `local` on random routings, for 2, 4 and 8 gloo ranks.

Each world size is spawned once (module fixture) and runs every case. Every rank has its own
tokens (different counts, some ranks none) and routing; the reference is `local` with every
expert on the concatenation of all ranks' tokens, rank 0's first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dispatch_cases import Case, assert_matches_local, run_cases
from ranks import run_ranks

from moeserve.dispatch import ExpertPlacement, create_dispatcher
from moeserve.dispatch.all_to_all import LOW_LATENCY_MAX_TOKENS

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
    """Every case at 2 and 4 ranks; at 8 (eight processes on a small machine) every other one,
    the rank without experts among them."""
    world_size = request.param
    cases = cases_for(world_size) if world_size < 8 else cases_for(world_size)[1::2]
    return world_size, cases, run_ranks(world_size, run_cases, cases)


def test_torch_equals_local(world: tuple[int, list[Case], list[dict]], one_thread: None) -> None:
    world_size, cases, results = world
    assert_matches_local(world_size, cases, results, LOW_LATENCY_MAX_TOKENS)


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
