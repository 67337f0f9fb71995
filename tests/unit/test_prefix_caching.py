"""Prefix caching in the scheduler: content hashes, the block manager's cache and LRU, admission
at the cached offset, and a random workload checked against a fake KV pool that remembers which
tokens wrote each slot."""

from __future__ import annotations

import pytest
from helpers.scheduler import EOS

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import BlockManager, Request
from moeserve.scheduler.block_hash import block_hashes, hash_block


def make_request(request_id: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0)


def compute(manager: BlockManager, request: Request, num_tokens: int) -> None:
    """What a step does for `request`: blocks for its next tokens, then their KV registered."""
    assert manager.allocate(request, num_tokens)
    before = request.num_computed_tokens
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request, before)


def admit(manager: BlockManager, request: Request) -> int:
    """Admit with the cached prefix and compute the rest of the tokens; returns the cached tokens."""
    cached = manager.lookup(request)
    assert manager.allocate(request, request.num_tokens - len(cached) * manager.block_size, cached)
    request.num_computed_tokens = len(cached) * manager.block_size
    before = request.num_computed_tokens
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request, before)
    return before


# ----- hashes -----


def test_block_hashes_chain_over_every_earlier_token_and_are_stable():
    first = hash_block(None, [1, 2, 3, 4])
    assert first.hex() == "73e200e2b048c86d4e8c86b86bf62bbda84c7384e34e250b01aa30ab29d234a4"  # same in every process
    assert hash_block(first, [5, 6, 7, 8]).hex() == "d6c3196cb2db3ef52af9bf96fe85966089108e7e3524783840e64898b3da413e"
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    c = make_request("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # differs before the second block only
    ha, hb, hc = (block_hashes(r, 4, 8) for r in (a, b, c))
    assert len(ha) == 2  # nine tokens fill two blocks of four
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert ha[0] != hc[0] and ha[1] != hc[1]  # same tokens in block 1, different history
    assert hash_block(None, [5, 6, 7, 8]) != ha[1]
    a.output_token_ids += [10, 11, 12]
    assert block_hashes(a, 4, 8) == [*ha, hash_block(ha[1], [9, 10, 11, 12])]  # outputs fill blocks too


# ----- the block manager -----


def test_a_request_reuses_the_full_blocks_of_a_shared_prefix_but_never_its_last_token():
    manager = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    first = make_request("first", list(range(10)))  # blocks [0-3], [4-7] full, [8, 9] partial
    assert admit(manager, first) == 0
    assert manager.num_cached_blocks == 2  # the partial third block is not cached
    same_prefix = make_request("same", list(range(10)) + [50, 51])
    assert admit(manager, same_prefix) == 8
    assert same_prefix.block_ids[:2] == first.block_ids[:2] and same_prefix.block_ids[2] != first.block_ids[2]
    exactly_two_blocks = make_request("exact", list(range(8)))
    assert manager.lookup(exactly_two_blocks) == first.block_ids[:1]  # its last token must be computed
    other = make_request("other", [99, *range(1, 10)])
    assert manager.lookup(other) == []


def test_a_chunk_caches_only_the_blocks_it_completed():
    manager = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    writer = make_request("writer", list(range(12)))
    reader = make_request("reader", list(range(12)) + [7])
    compute(manager, writer, 3)
    assert manager.lookup(reader) == []  # block 0 is three quarters written
    compute(manager, writer, 3)
    assert manager.lookup(reader) == writer.block_ids[:1]
    compute(manager, writer, 6)
    assert manager.lookup(reader) == writer.block_ids[:3]


def test_shared_blocks_are_counted_and_survive_until_the_last_holder_leaves():
    manager = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    b = make_request("b", [1, 2, 3, 4, 6])
    admit(manager, a)
    admit(manager, b)
    assert a.block_ids[:2] == b.block_ids[:2]
    assert manager.num_used_blocks == 4  # two shared + one own each
    manager.free(a)
    assert manager.num_used_blocks == 3 and manager.lookup(b) == b.block_ids[:2]
    # Every other block may be taken, but not those b still holds: allocation fails instead.
    hog = make_request("hog", [9] * 12)
    assert not manager.allocate(hog, 7)  # 4 blocks wanted, 3 free
    assert manager.allocate(hog, 6)
    assert not set(hog.block_ids) & set(b.block_ids)
    assert manager.lookup(b) == b.block_ids[:2]


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_released_tail_first():
    manager = BlockManager(num_blocks=5, block_size=2, enable_caching=True)
    old = make_request("old", [1, 2, 3, 4, 5])  # two full blocks cached, one partial
    new = make_request("new", [7, 8, 9, 10])  # two full blocks cached
    admit(manager, old)
    admit(manager, new)
    manager.free(old)  # released first: least recently used
    manager.free(new)
    assert manager.num_free_blocks == 5 and manager.num_cached_blocks == 4

    def cached_prefixes() -> tuple[int, int]:
        probes = make_request("o", [1, 2, 3, 4, 0]), make_request("n", [7, 8, 9, 10, 0])
        return len(manager.lookup(probes[0])), len(manager.lookup(probes[1]))

    taker = make_request("taker", [0] * 10)
    left = []
    for _ in range(5):
        assert manager.allocate(taker, 2)
        taker.num_computed_tokens += 2
        left.append(cached_prefixes())
    # old's partial block (nothing cached) goes first, then old's tail, old's head, new's tail, new's head.
    assert left == [(2, 2), (1, 2), (0, 2), (0, 1), (0, 0)]


def test_allocation_is_all_or_nothing_counting_the_cached_blocks_it_revives():
    manager = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    first = make_request("first", [1, 2, 3, 4, 5])
    admit(manager, first)
    manager.free(first)  # 2 cached blocks, all 4 free
    holder = make_request("holder", [8, 8])
    assert manager.allocate(holder, 2)  # takes first's uncached partial block: 3 free, 2 cached
    second = make_request("second", [1, 2, 3, 4, 6, 6, 6, 6])
    cached = manager.lookup(second)
    assert len(cached) == 2
    assert not manager.allocate(second, 4, cached)  # 2 revived + 2 new > 3 free
    assert second.block_ids == [] and manager.num_free_blocks == 3 and manager.num_cached_blocks == 2
    assert manager.allocate(second, 2, cached)
    assert second.block_ids[:2] == cached and manager.num_free_blocks == 0


def test_a_block_computed_twice_stays_private_and_is_reused_first():
    manager = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = make_request("a", [1, 2, 3])
    b = make_request("b", [1, 2, 4])
    compute(manager, a, 3)
    compute(manager, b, 3)  # computed alongside a: its first block has a's content
    probe = make_request("probe", [1, 2, 5])
    assert manager.num_cached_blocks == 1 and manager.lookup(probe) == a.block_ids[:1]
    b_blocks = list(b.block_ids)
    manager.free(b)
    taker = make_request("taker", [0])
    assert manager.allocate(taker, 1)
    assert taker.block_ids == b_blocks[:1]  # the copy nobody can find goes first
    assert manager.lookup(probe) == a.block_ids[:1]


def test_without_caching_nothing_is_found():
    manager = BlockManager(num_blocks=4, block_size=2)
    first = make_request("first", [1, 2, 3])
    compute(manager, first, 3)
    assert manager.lookup(make_request("second", [1, 2, 3])) == [] and manager.num_cached_blocks == 0
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate(first, 1, [0])
