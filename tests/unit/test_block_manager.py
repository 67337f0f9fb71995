"""BlockManager: block tables cover the computed positions, allocation is all or nothing, and no
block is ever owned twice."""

import pytest

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import BlockManager, Request


def make_request(request_id: str = "r", num_computed_tokens: int = 0) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(), eos_token_ids=(), arrival_time=0.0)
    request.num_computed_tokens = num_computed_tokens
    return request


def assert_consistent(manager: BlockManager, *requests: Request) -> None:
    owned = [block_id for request in requests for block_id in request.block_ids]
    assert len(owned) == len(set(owned)), "a block has two owners"
    assert manager.num_used_blocks == len(owned)
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks


@pytest.mark.parametrize(
    ("num_computed", "num_new", "expected"),
    [(0, 1, 1), (0, 4, 1), (0, 5, 2), (3, 1, 1), (4, 1, 2), (0, 0, 0), (7, 9, 4)],
)
def test_blocks_needed_rounds_up_to_whole_blocks(num_computed, num_new, expected):
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.blocks_needed(make_request(num_computed_tokens=num_computed), num_new) == expected


def test_allocate_extends_the_table_only_when_a_block_boundary_is_crossed():
    manager = BlockManager(num_blocks=8, block_size=4)
    request = make_request()
    assert manager.allocate(request, 3)
    assert len(request.block_ids) == 1
    request.num_computed_tokens = 3
    assert manager.allocate(request, 1)  # position 3 still in block 0
    assert len(request.block_ids) == 1
    request.num_computed_tokens = 4
    assert manager.blocks_needed(request, 1) == 1
    assert manager.allocate(request, 1)
    assert len(request.block_ids) == 2
    assert_consistent(manager, request)


def test_allocate_is_all_or_nothing():
    manager = BlockManager(num_blocks=3, block_size=2)
    holder = make_request("holder")
    assert manager.allocate(holder, 3)  # two blocks
    request = make_request("r")
    assert not manager.allocate(request, 3)  # needs two, one left
    assert request.block_ids == []
    assert manager.num_free_blocks == 1
    assert manager.allocate(request, 2)
    assert manager.num_free_blocks == 0
    assert_consistent(manager, holder, request)


def test_free_returns_every_block_and_is_idempotent():
    manager = BlockManager(num_blocks=4, block_size=2)
    request = make_request()
    manager.allocate(request, 7)
    assert manager.num_free_blocks == 0
    manager.free(request)
    assert request.block_ids == []
    assert manager.num_free_blocks == 4
    manager.free(request)
    assert manager.num_free_blocks == 4
    assert manager.usage == 0.0


def test_blocks_are_never_handed_out_twice_across_churn():
    manager = BlockManager(num_blocks=6, block_size=1)
    requests = [make_request(str(i)) for i in range(3)]
    for round_ in range(30):
        for request in requests:
            if manager.allocate(request, 1):
                request.num_computed_tokens += 1
            assert_consistent(manager, *requests)
        if round_ % 4 == 3:
            victim = requests[round_ % 3]
            manager.free(victim)
            victim.num_computed_tokens = 0
            assert_consistent(manager, *requests)


def test_freeing_a_block_not_in_use_is_an_error():
    manager = BlockManager(num_blocks=2, block_size=1)
    impostor = make_request()
    impostor.block_ids = [0]
    with pytest.raises(RuntimeError, match="not in use"):
        manager.free(impostor)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0)])
def test_rejects_empty_geometry(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)
