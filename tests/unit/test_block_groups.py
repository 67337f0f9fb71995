"""Block tables per group of paged specs: a compressed group takes a block per block_size x ratio
positions, a window group gives back what falls behind its window, growth is all or nothing."""

from __future__ import annotations

import pytest
from helpers.scheduler import make_request, token_for

from moeserve.cache_spec import BlockGroup, CacheSpecs, PagedSpec
from moeserve.scheduler import DataParallelScheduler, Scheduler, SchedulerConfig
from moeserve.scheduler.block_groups import (
    RELEASED,
    GroupBlocks,
    GroupedBlockManager,
    GroupedBlocks,
    group_block_counts,
)
from moeserve.worker.kv_cache import context_blocks

WINDOW, COMPRESSED = (1, 8), (4, None)


def grouped_config(window_blocks: int, compressed_blocks: int, context_blocks: int) -> SchedulerConfig:
    """Two sequences at most, in steps of 8 tokens, blocks of 4, a WINDOW and a COMPRESSED pool."""
    return SchedulerConfig(
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=context_blocks,
        block_groups=((WINDOW, window_blocks), (COMPRESSED, compressed_blocks)),
    )


def test_compressed_group_takes_a_block_per_block_size_times_ratio():
    blocks = GroupedBlocks([COMPRESSED], [10], block_size=4)
    assert blocks.allocate("a", 0, 15)  # 3 closed windows: one block of 4 entries
    assert len(blocks.tables("a")[COMPRESSED]) == 1
    assert blocks.allocate("a", 15, 2)  # 17 positions: 4 entries, still one block
    assert len(blocks.tables("a")[COMPRESSED]) == 1
    assert blocks.allocate("a", 17, 3)  # 20 positions: 5 entries, a second block
    assert len(blocks.tables("a")[COMPRESSED]) == 2


def test_window_group_gives_back_blocks_behind_the_window():
    blocks = GroupedBlocks([WINDOW], [6], block_size=4)
    assert blocks.allocate("a", 0, 16)  # 4 blocks, none behind the window yet
    assert blocks.num_free(WINDOW) == 2
    assert blocks.allocate("a", 16, 1)  # queries from 16 read from 9 on: blocks 0 and 1 go back
    assert blocks.tables("a")[WINDOW][:2] == [RELEASED, RELEASED]
    assert blocks.num_free(WINDOW) == 3
    assert BlockGroup(*WINDOW).blocks_held(17, 4) == 3  # what the planner prices: the blocks still held
    blocks.free("a")
    assert blocks.num_free(WINDOW) == 6


def test_usage_per_group_after_allocate_and_free_and_over_data_parallel_groups():
    """What /metrics labels by group: each group's blocks held and pool, as the request grows
    (window blocks going back) and frees; data-parallel groups' pools add up."""
    manager = GroupedBlockManager([WINDOW, COMPRESSED], [6, 3], block_size=4)
    request = make_request("a", prompt_len=20)
    assert manager.allocate(request, 16)  # 16 positions: 4 window blocks, 4 entries in one block
    assert manager.group_blocks == (GroupBlocks("window", 4, 6), GroupBlocks("compressed_4", 1, 3))
    request.num_computed_tokens = 16
    assert manager.allocate(request, 4)  # from 16 on, blocks 0 and 1 lie behind the window; 5 entries
    assert manager.group_blocks == (("window", 3, 6), ("compressed_4", 2, 3))
    assert manager.num_used_blocks == 5 and manager.num_blocks == 9  # the unlabelled gauges: the sums
    manager.free(request)
    assert manager.group_blocks == (("window", 0, 6), ("compressed_4", 0, 3))
    dp = DataParallelScheduler(grouped_config(window_blocks=6, compressed_blocks=3, context_blocks=16), 2)
    assert dp.group_blocks == (("window", 0, 12), ("compressed_4", 0, 6)) and dp.num_kv_blocks == 18
    with pytest.raises(ValueError, match="distinct names"):  # they label /metrics series
        GroupedBlockManager([(1, 8), (1, 16)], [4, 4], block_size=4)


def test_trim_gives_back_every_group_s_blocks_past_the_kept_tokens():
    """A verify step from 17 with 3 drafts (21 positions) keeps none (19 tokens, the sampled one's
    included): the window's sixth block and the second compressed block, taken for the rejected
    ones, go back; the window's blocks behind it stay given back, those the next queries read stay."""
    blocks = GroupedBlocks([WINDOW, COMPRESSED], [8, 3], block_size=4)
    assert blocks.allocate("a", 0, 17) and blocks.allocate("a", 17, 4)
    window, compressed = (list(blocks.tables("a")[key]) for key in (WINDOW, COMPRESSED))
    assert window[:2] == [RELEASED, RELEASED] and len(window) == 6 and len(compressed) == 2
    blocks.trim("a", 19)
    assert blocks.tables("a") == {WINDOW: window[:5], COMPRESSED: compressed[:1]}
    assert (blocks.num_free(WINDOW), blocks.num_free(COMPRESSED)) == (5, 2)
    blocks.trim("b", 4)  # a request holding nothing: nothing to give back
    blocks.free("a")
    assert (blocks.num_free(WINDOW), blocks.num_free(COMPRESSED)) == (8, 3)


def test_growth_is_all_or_nothing_across_groups():
    blocks = GroupedBlocks([WINDOW, COMPRESSED], [8, 1], block_size=4)
    assert blocks.allocate("a", 0, 16)
    held = {k: list(t) for k, t in blocks.tables("a").items()}
    assert not blocks.allocate("a", 16, 4)  # the compressed group would need a second block
    assert blocks.tables("a") == held
    assert (blocks.num_free(WINDOW), blocks.num_free(COMPRESSED)) == (4, 0)


def test_scheduler_hands_out_a_table_per_group_and_preemption_returns_every_group():
    """Two requests of 40 positions in chunks of 8: each needs 3 compressed blocks of the 4, so the
    newer is preempted and recomputes; the window pool (8 blocks, a request's 40 positions being
    10) lasts only because blocks behind the window go back. Everything is free at the end."""
    config = grouped_config(window_blocks=8, compressed_blocks=4, context_blocks=16)
    scheduler = Scheduler(config)
    for request_id in "ab":
        scheduler.add_request(make_request(request_id, prompt_len=30, max_tokens=10))
    released, preempted = False, []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        preempted += output.preempted_request_ids
        for s in output.scheduled:
            end = s.start_position + len(s.token_ids)
            assert not s.block_ids and set(s.group_tables) == {WINDOW, COMPRESSED}
            assert len(s.group_tables[WINDOW]) == -(-end // 4)
            assert len(s.group_tables[COMPRESSED]) == -(-(end // 4) // 4)  # a block per 4 entries of 4
            live = s.group_tables[WINDOW][max(0, s.start_position - 7) // 4 :]
            assert RELEASED not in live  # what the window reads is held
            released = released or RELEASED in s.group_tables[WINDOW]
        sampled = {s.request_id: token_for(s.request_id, 0) for s in output.scheduled if s.sample}
        scheduler.update(output, sampled)
    assert released and set(preempted) == {"b"}  # the newer one, as with one table
    assert scheduler.block_manager.num_used_blocks == 0


def test_budget_buys_window_pools_first_then_context_by_bytes_per_position():
    window, entries = PagedSpec((), (8,), "float32", window=8), PagedSpec((), (8,), "float32", tokens_per_entry=4)
    specs = CacheSpecs(((window, entries),) * 2)
    sizes = specs.group_bytes_per_block(4)
    assert sizes == (2 * 4 * 8 * 4, 2 * 4 * 8 * 4)
    pools = group_block_counts(specs.groups, 1000, 4, 2, 8)
    assert pools[0] == 2 * (2 + 2) + 2  # two sequences' windows and a block either side, a step's tokens
    blocks = [context_blocks(specs, budget, 4, 2, 8, most=1000) for budget in (20_000, 40_000)]
    for budget, n in zip((20_000, 40_000), blocks):
        used = sum(c * s for c, s in zip(group_block_counts(specs.groups, n, 4, 2, 8), sizes))
        assert used <= budget < used + 4 * sizes[1]  # the rest buys compressed entries, to within a block of context
    assert context_blocks(specs, 10**9, 4, 2, 8, most=100) == 100
