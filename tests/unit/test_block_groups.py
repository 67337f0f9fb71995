"""Block tables per group of paged specs: a compressed group takes a block per block_size x ratio
positions, a window group gives back what falls behind its window, growth is all or nothing;
prefix caching across the groups (hits at block boundaries of every group with a saved state)."""

from __future__ import annotations

import random

import pytest
from helpers.scheduler import make_request, token_for

from moeserve.cache_spec import BlockGroup, CacheSpecs, PagedSpec
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Scheduler, SchedulerConfig
from moeserve.scheduler.block_groups import (
    RELEASED,
    GroupBlocks,
    GroupedBlockManager,
    GroupedBlocks,
    group_block_counts,
)
from moeserve.scheduler.request import Request
from moeserve.worker.kv_cache import context_blocks

WINDOW, COMPRESSED = (1, 8), (4, None)
COARSE = (16, None)  # with block 4: a block of every group ends every 64 positions
PROMPT = [3 + (7 * i) % 290 for i in range(200)]


def _grouped_scheduler(block_groups, **limits) -> Scheduler:
    """Two sequences in blocks of 4 over these groups' pools (64 blocks of context)."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=2, block_size=4, num_kv_blocks=64, block_groups=block_groups, **limits)
    )


def _request(request_id: str, num_tokens: int, max_tokens: int = 4) -> Request:
    return Request(request_id, PROMPT[:num_tokens], SamplingParams(max_tokens=max_tokens), (0,), arrival_time=0.0)


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


def test_a_hit_resumes_at_a_boundary_of_every_group_from_a_saved_state_and_given_back_window_blocks():
    """A 150-token prompt saves its open windows at its mark, 128 (a multiple of 4 x 16); a later
    200-token prompt sharing it resumes there: its compressed tables begin with the first one's
    blocks, its window table with the two blocks the first one gave back as its window moved on
    (positions 120 to 127; nothing before them: `RELEASED`), and it starts from the saved state."""
    pools = ((WINDOW, 12), (COMPRESSED, 20), (COARSE, 8))
    scheduler = _grouped_scheduler(pools, max_num_batched_tokens=16, max_model_len=256, num_saved_states=2)
    plans = {}

    def run(request):
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            for s in output.scheduled:
                plans[s.request_id, s.start_position + len(s.token_ids)] = (s, output.prefix_cache_hits)
            sampled = {s.request_id: token_for(s.request_id, 0) for s in output.scheduled if s.sample}
            scheduler.update(output, sampled)

    run(_request("first", 150))
    saved_at_mark, _ = plans["first", 128]
    assert saved_at_mark.save_state >= 0
    run(_request("second", 200))
    resumed, hits = plans["second", 144]
    assert (resumed.start_position, hits, resumed.load_state) == (128, 128, saved_at_mark.save_state)
    held = saved_at_mark.group_tables
    assert resumed.group_tables[WINDOW][:32] == [RELEASED] * 30 + held[WINDOW][30:32]
    assert resumed.group_tables[COMPRESSED][:8] == held[COMPRESSED][:8]
    assert resumed.group_tables[COARSE][:2] == held[COARSE][:2]
    assert scheduler.block_manager.num_used_blocks == 0


def _compute(manager: GroupedBlockManager, request: Request, upto: int) -> None:
    """Run `request` to `upto` positions in steps ending at multiples of 64, as the scheduler's
    chunks cut at its marks: grow, compute, register the full blocks, save the state there."""
    while request.num_computed_tokens < upto:
        before = request.num_computed_tokens
        assert manager.allocate(request, min(upto, (before // 64 + 1) * 64) - before)
        request.num_computed_tokens = min(upto, (before // 64 + 1) * 64)
        manager.cache_full_blocks(request, before)
        manager.save_state(request, request.num_computed_tokens)
        manager.commit_saved_states()


def test_a_hit_whose_window_block_was_evicted_falls_back_to_a_shorter_one_and_nothing_leaks():
    manager = GroupedBlockManager([WINDOW, COMPRESSED, COARSE], [40, 40, 10], 4, True, 4)
    first = _request("first", 150)
    _compute(manager, first, 150)
    manager.free(first)  # states saved at 64 and 128; window blocks 14-15 and 30-31 kept, given back in that order
    assert manager.lookup(_request("probe", 200)).num_tokens == 128
    reader = _request("reader", 100)
    hit = manager.lookup(reader)
    assert hit.num_tokens == 64 and hit.tables[WINDOW] == (RELEASED,) * 14 + hit.tables[WINDOW][14:16]
    assert manager.allocate(reader, 36, hit)
    reader.num_computed_tokens = 100
    assert manager.allocate(reader, 1)  # its window moves past 64: blocks 14-15 given back again, last
    manager.free(reader)
    cached = manager.num_cached_blocks
    unrelated = Request("unrelated", [1] * 148, SamplingParams(max_tokens=1), (0,), arrival_time=0.0)
    assert manager.allocate(unrelated, 148)  # 37 window blocks: every uncached free one and the oldest cached
    assert manager.num_cached_blocks == cached - 1
    assert manager.lookup(_request("probe", 200)).num_tokens == 64
    manager.free(unrelated)
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == 90


class _RowsPool:
    """A fake V4 cache: each row a step writes holds the tokens it was computed from (the prefix up
    to its last position), each saved state the prefix at its mark; every row and state a step
    reads is checked to hold its own sequence's prefix, so a block shared, given back or evicted
    wrongly shows up as another prefix's row."""

    def __init__(self, block_size: int, alignment: int) -> None:
        self.block_size, self.alignment = block_size, alignment
        self.rows: dict[tuple, tuple[int, ...]] = {}
        self.saved: dict[int, tuple[int, ...]] = {}

    def run(self, scheduler: Scheduler, output, requests: dict[str, Request]) -> None:
        for s in output.scheduled:
            start, end = s.start_position, s.start_position + len(s.token_ids)
            tokens = tuple(requests[s.request_id].token_ids_between(0, end))
            if s.load_state >= 0:
                assert self.saved[s.load_state] == tokens[:start]
            for (per_entry, window), table in s.group_tables.items():
                first = 0 if window is None else max(0, start - window + 1)
                for row in range(-(-first // per_entry), end // per_entry):
                    where = ((per_entry, window), table[row // self.block_size], row % self.block_size)
                    if row < start // per_entry:
                        assert self.rows[where] == tokens[: (row + 1) * per_entry]
                    else:
                        self.rows[where] = tokens[: (row + 1) * per_entry]
            if s.save_state >= 0:
                assert end % self.alignment == 0
                self.saved[s.save_state] = tokens


def test_random_shared_prefixes_read_only_their_own_rows_through_hits_eviction_and_preemption():
    """Requests on two long shared prefixes, in pools too small for two of them at once: hits,
    evictions and preemptions all happen, every row a step reads holds its own prefix, and
    every block is free at the end."""
    pools = ((WINDOW, 12), (COMPRESSED, 14), (COARSE, 5))
    scheduler = _grouped_scheduler(
        pools, max_num_batched_tokens=16, max_model_len=256, num_saved_states=3, state_save_interval=16
    )
    pool, rng, requests = _RowsPool(4, 64), random.Random(44), {}
    prefixes = [[rng.randint(3, 300) for _ in range(rng.randint(100, 130))] for _ in range(2)]
    hits = preemptions = evictions = 0
    for index in range(600):
        if index < 200 and rng.random() < 0.1:
            tokens = rng.choice(prefixes) + [rng.randint(3, 300) for _ in range(rng.randint(0, 30))]
            request = Request(f"r{index}", tokens, SamplingParams(max_tokens=rng.randint(1, 8)), (0,), 0.0)
            scheduler.add_request(request)
            requests[request.request_id] = request
        cached = scheduler.block_manager.num_cached_blocks
        output = scheduler.schedule()
        evictions += max(0, cached - scheduler.block_manager.num_cached_blocks)  # only eviction forgets
        pool.run(scheduler, output, requests)
        hits += output.prefix_cache_hits
        preemptions += len(output.preempted_request_ids)
        sampled = {s.request_id: token_for(s.request_id, 0) for s in output.scheduled if s.sample}
        scheduler.update(output, sampled)
        if index >= 200 and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert hits > 0 and preemptions > 0 and evictions > 0
    assert scheduler.block_manager.num_used_blocks == 0
