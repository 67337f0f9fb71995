"""The `torch` backend's steps: the same bytes as dispatch()/combine(), really yielding while a
collective is in flight, and correct with two passes in flight at once (two-batch overlap)."""

from __future__ import annotations

import pytest
import torch
from dispatch_cases import Case
from dispatch_steps_cases import run_steps
from ranks import run_ranks

TOKENS = (0, 13, 7, 22)


def cases(world_size: int) -> list[Case]:
    tokens = TOKENS[:world_size]
    return [
        Case("E8-k2-uniform", 8, 2, "uniform", "contiguous", tokens, torch.float32, seed=1),
        Case("E7-k3-skewed-bf16", 7, 3, "skewed", "round_robin", tokens, torch.bfloat16, seed=2),
    ]


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda n: f"ranks{n}")
def test_steps_equal_dispatch_and_yield(world_size: int) -> None:
    results = run_ranks(world_size, run_steps, cases(world_size))
    for rank, per_case in enumerate(results):
        for case, per_mode in zip(cases(world_size), per_case):
            for mode, got in per_mode.items():
                where = f"{case.name}, rank {rank}, {mode}"
                plain_hidden, plain_counts, plain_host, plain_out = got["plain"]
                hidden, counts, host, out = got["stepped"]
                assert torch.equal(hidden, plain_hidden), where
                assert torch.equal(counts, plain_counts), where
                assert host == plain_host, where
                assert torch.equal(out, plain_out), where
                # uneven: counts, then (after the host read) the payload; low-latency: both at once
                assert got["yields"] == ((2, 1) if mode == "uneven" else (1, 1)), where
                assert torch.equal(got["halves"], got["halves_sequential"]), where
                assert torch.equal(got["halves"], plain_out), where  # row-wise toy experts: batch-invariant
                assert got["halves"].shape[0] == case.tokens_per_rank[rank], where
