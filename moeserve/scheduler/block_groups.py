"""Block tables per group of paged specs (docs/architecture.md, "Cache specs"): what a model whose
layers keep several kinds of paged cache (DeepSeek-V4: a sliding window, entries compressed from
4 or from 128 positions) needs of the block pool, read from its specs alone.

Each group (`PagedSpec.group_key`: tokens per entry, window) has its own free list and gives each
request its own table. A table indexes absolute rows: block i of a group holds its rows
`i * block_size ..`, a row being one position, or one closed window of `tokens_per_entry`
positions. Growth is all or nothing across the groups, so a request that cannot grow holds what
it held. A window group gives back the blocks wholly behind the window as the request advances:
their table entries become `RELEASED` (never read again).

`GroupedBlockManager` is what `Scheduler` holds in place of `BlockManager` for such a model: the
same calls, each request's tables per group in the plan (`ScheduledRequest.group_tables`); after a
verify step every group gives back the blocks past the kept tokens (`trim`). Prefix caching and
pinning for transfers are not built for several groups (the engine refuses them first).
`group_block_counts` sizes each group's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from moeserve.cache_spec import BlockGroup, GroupKey, group_names
from moeserve.scheduler.request import Request
from moeserve.scheduler.saved_states import SavedStates

RELEASED = -1
"""The table entry of a window block given back: nothing reads it any more."""


class GroupBlocks(NamedTuple):
    """One block-table group's usage, for /metrics: its name (`BlockGroup.name`: `full`,
    `window`, `compressed_4` ...), the blocks requests hold, the blocks of its pool."""

    group: str
    used: int
    total: int


class GroupedBlocks:
    """`num_blocks[g]` blocks of `block_size` rows for each group `groups[g]`."""

    def __init__(self, groups: Sequence[GroupKey], num_blocks: Sequence[int], block_size: int) -> None:
        if len(groups) != len(num_blocks) or min(num_blocks, default=1) < 1 or block_size < 1:
            raise ValueError(f"one count of at least 1 per group and a block size of at least 1: {num_blocks}")
        self.block_size = block_size
        self.groups = {key: BlockGroup(*key) for key in groups}
        self._free = {key: list(range(n - 1, -1, -1)) for key, n in zip(groups, num_blocks, strict=True)}
        self._tables: dict[str, dict[GroupKey, list[int]]] = {}

    def num_free(self, key: GroupKey) -> int:
        return len(self._free[key])

    def tables(self, request_id: str) -> dict[GroupKey, list[int]]:
        return self._tables.get(request_id, {key: [] for key in self.groups})

    def allocate(self, request_id: str, start: int, num_new_tokens: int) -> bool:
        """Tables covering positions `[0, start + num_new_tokens)` of a request whose queries now
        begin at `start` (window blocks behind it given back); False, taking nothing, when any
        group's free list is too short."""
        tables = self.tables(request_id)
        end = start + num_new_tokens
        needed = {key: max(0, g.blocks_for(end, self.block_size) - len(tables[key])) for key, g in self.groups.items()}
        dead = {
            key: [i for i in range(g.dead_blocks(start, self.block_size)) if tables[key][i] != RELEASED]
            for key, g in self.groups.items()
        }
        if any(n > len(self._free[key]) + len(dead[key]) for key, n in needed.items()):
            return False
        for key, n in needed.items():
            for i in dead[key]:  # behind the window first, so that growth can reuse them
                self._free[key].append(tables[key][i])
                tables[key][i] = RELEASED
            tables[key].extend(self._free[key].pop() for _ in range(n))
        self._tables[request_id] = tables
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back, tail first, the blocks of the request's tables past its first `num_tokens`
        positions: those a verify step took for drafts the target rejected. Only the tail goes,
        so every block a later query reads (the window's included) stays."""
        for key, table in self._tables.get(request_id, {}).items():
            keep = self.groups[key].blocks_for(num_tokens, self.block_size)
            while len(table) > keep:
                block = table.pop()
                if block != RELEASED:
                    self._free[key].append(block)

    def free(self, request_id: str) -> None:
        """Give back every block the request holds; a second call is a no-op."""
        for key, table in self._tables.pop(request_id, {}).items():
            self._free[key].extend(b for b in reversed(table) if b != RELEASED)


def group_block_counts(
    groups: Sequence[GroupKey], context_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[int, ...]:
    """Each group's pool when the cache holds `context_blocks * block_size` positions of context:
    a compressed group the blocks of their entries (and one partly filled block per sequence), a
    window group what its running sequences can read at once (each its window and a block either
    side, the step's tokens besides), never more than the context itself."""
    counts = []
    for tokens_per_entry, window in groups:
        if window is None:
            counts.append(-(-context_blocks // tokens_per_entry) + max_num_seqs)
        else:
            live = max_num_seqs * (-(-window // block_size) + 2) + -(-max_num_batched_tokens // block_size)
            counts.append(min(live, context_blocks))
    return tuple(counts)


class GroupedBlockManager:
    """`BlockManager`'s part the scheduler calls, over one `GroupedBlocks`: a request's table per
    group instead of `Request.block_ids`. Block counts (`num_blocks`, free, used) are the groups'
    together, for the usage gauge and data-parallel routing; `group_blocks` each group's."""

    enable_caching = False
    has_state = True

    def __init__(self, groups: Sequence[GroupKey], num_blocks: Sequence[int], block_size: int) -> None:
        self.blocks = GroupedBlocks(groups, num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = sum(num_blocks)
        self._pools = tuple(zip(group_names(tuple(groups)), groups, num_blocks, strict=True))
        self.num_cached_blocks = 0
        self.saved_states = SavedStates(0)

    @property
    def num_free_blocks(self) -> int:
        return sum(self.blocks.num_free(key) for key in self.blocks.groups)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def group_blocks(self) -> tuple[GroupBlocks, ...]:
        """Each group's blocks held and pool, in the groups' order."""
        return tuple(GroupBlocks(name, n - self.blocks.num_free(key), n) for name, key, n in self._pools)

    def group_tables(self, request: Request) -> dict[GroupKey, list[int]]:
        """A copy of `request`'s table per group, for the plan."""
        return {key: list(table) for key, table in self.blocks.tables(request.request_id).items()}

    def lookup(self, request: Request) -> list[int]:
        return []

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Every group's table covering the request's next `num_new_tokens` positions, all or nothing."""
        if cached_blocks:
            raise ValueError("prefix caching is not built for several block-table groups")
        return self.blocks.allocate(request.request_id, request.num_computed_tokens, num_new_tokens)

    def free(self, request: Request) -> None:
        self.blocks.free(request.request_id)

    def cache_full_blocks(self, request: Request, num_computed_before: int) -> None:
        """Nothing is registered: no prefix caching."""

    def commit_saved_states(self) -> None:
        """No saved states: nothing to commit."""

    def drop_pending_states(self) -> None:
        """No saved states: nothing pending."""

    def trim(self, request: Request, num_tokens: int) -> None:
        """Every group's blocks past the request's first `num_tokens` positions given back (rejected drafts')."""
        self.blocks.trim(request.request_id, num_tokens)

    def pin(self, block_ids: Sequence[int]) -> None:
        raise NotImplementedError("KV transfers are not built for several block-table groups")

    unpin = pin
