"""Block tables per group of paged specs (docs/architecture.md, "Cache specs"): what a model whose
layers keep several kinds of paged cache (DeepSeek-V4: a sliding window, entries compressed from
4 or from 128 positions) needs of the block pool, read from its specs alone.

Each group (`PagedSpec.group_key`: tokens per entry, window) has its own free list and gives each
request its own table. A table indexes absolute rows: block i of a group holds its rows
`i * block_size ..`, a row being one position, or one closed window of `tokens_per_entry`
positions. Growth is all or nothing across the groups, so a request that cannot grow holds what
it held. A window group gives back the blocks wholly behind the window as the request advances:
their table entries become `RELEASED` (never read again).

Not yet wired into `Scheduler`, which hands each request one table (`BlockManager`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

RELEASED = -1
"""The table entry of a window block given back: nothing reads it any more."""

GroupKey = tuple[int, int | None]


@dataclass(frozen=True)
class Group:
    tokens_per_entry: int
    window: int | None

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks holding the rows of a request's first `num_tokens` positions."""
        return -(-(num_tokens // self.tokens_per_entry) // block_size)

    def dead_blocks(self, start: int, block_size: int) -> int:
        """Leading blocks no query from position `start` on reads: behind the window (0 without one)."""
        if self.window is None:
            return 0
        return max(0, start - self.window + 1) // block_size


class GroupedBlocks:
    """`num_blocks[g]` blocks of `block_size` rows for each group `groups[g]`."""

    def __init__(self, groups: Sequence[GroupKey], num_blocks: Sequence[int], block_size: int) -> None:
        if len(groups) != len(num_blocks) or min(num_blocks, default=1) < 1 or block_size < 1:
            raise ValueError(f"one count of at least 1 per group and a block size of at least 1: {num_blocks}")
        self.block_size = block_size
        self.groups = {key: Group(*key) for key in groups}
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

    def free(self, request_id: str) -> None:
        """Give back every block the request holds; a second call is a no-op."""
        for key, table in self._tables.pop(request_id, {}).items():
            self._free[key].extend(b for b in reversed(table) if b != RELEASED)
