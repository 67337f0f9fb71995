"""`--on-rank-failure` and `--min-ranks`: what a heal needs is checked before anything starts."""

from __future__ import annotations

import pytest

from moeserve.engine_config import EngineConfig, ParallelConfig


def test_heal_is_the_default_where_the_layout_can_heal():
    def policy(**options) -> str:
        return EngineConfig.from_options(**options).parallel.on_rank_failure

    assert policy(ep=4, device="cpu") == "heal"
    assert policy(ep=1, device="cpu") == "exit"
    assert policy(ep=4, tp=2, device="cpu") == "exit"
    assert policy(ep=4, a2a_backend="nvshmem", device="cpu") == "exit"
    assert policy(ep=4, on_rank_failure="exit", device="cpu") == "exit"
    assert ParallelConfig(ep=4).resolved("cuda").on_rank_failure == "exit"  # NCCL cannot heal yet
    assert EngineConfig.from_options(ep=4, on_rank_failure="heal", min_ranks=2, device="cpu").parallel.min_ranks == 2


def test_restarts_cannot_be_negative():
    with pytest.raises(ValueError, match="rank_restarts"):
        ParallelConfig(ep=4, rank_restarts=-1)


@pytest.mark.parametrize(
    ("layout", "why"),
    [
        (dict(ep=1), "ep >= 2"),
        (dict(ep=4, tp=2), "tp 1"),
        (dict(ep=4, nnodes=2, master_port=29511), "one node"),
        (dict(ep=4, backend="nccl"), "gloo"),
        (dict(ep=4, a2a_backend="nvshmem"), "torch all-to-all"),
    ],
)
def test_heal_refuses_layouts_it_cannot_heal(layout, why):
    with pytest.raises(ValueError, match=why):
        ParallelConfig(on_rank_failure="heal", **layout)


@pytest.mark.parametrize("min_ranks", [0, 5])
def test_min_ranks_must_fit_the_group(min_ranks):
    with pytest.raises(ValueError, match="min_ranks"):
        ParallelConfig(ep=4, on_rank_failure="heal", min_ranks=min_ranks)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="on_rank_failure"):
        ParallelConfig(ep=2, on_rank_failure="restart")
