"""Block tables per group of paged specs: a compressed group takes a block per block_size x ratio
positions, a window group gives back what falls behind its window, growth is all or nothing."""

from __future__ import annotations

from moeserve.scheduler.block_groups import RELEASED, GroupedBlocks

WINDOW, COMPRESSED = (1, 8), (4, None)


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
    blocks.free("a")
    assert blocks.num_free(WINDOW) == 6


def test_growth_is_all_or_nothing_across_groups():
    blocks = GroupedBlocks([WINDOW, COMPRESSED], [8, 1], block_size=4)
    assert blocks.allocate("a", 0, 16)
    held = {k: list(t) for k, t in blocks.tables("a").items()}
    assert not blocks.allocate("a", 16, 4)  # the compressed group would need a second block
    assert blocks.tables("a") == held
    assert (blocks.num_free(WINDOW), blocks.num_free(COMPRESSED)) == (4, 0)
