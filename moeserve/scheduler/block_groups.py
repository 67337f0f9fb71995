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
same calls, each request's tables per group in the plan (`ScheduledRequest.group_tables`), prefix
caching included (hits at block boundaries of every group, from saved open-window states), the
pins and loads of prefill/decode disaggregation (a prompt's tables up to its mark and the saved
state there, `hold_prompt` and `allocate_load`); after a verify step every group gives back the
blocks past the kept tokens (`trim`). `group_block_counts` sizes each group's pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import lcm
from typing import NamedTuple

from moeserve.cache_spec import BlockGroup, GroupKey, group_names
from moeserve.scheduler.block_hash import BlockHash, block_hashes
from moeserve.scheduler.request import Request
from moeserve.scheduler.saved_states import SavedStates, reserve_load_slot

RELEASED = -1
"""The table entry of a window block given back: nothing reads it any more."""

GroupBlockIds = tuple[tuple[int, ...], ...]
"""Block ids per group, in the groups' order, `RELEASED` where there is none (a transfer's)."""


class GroupBlocks(NamedTuple):
    """One block-table group's usage, for /metrics: its name (`BlockGroup.name`: `full`,
    `window`, `compressed_4` ...), the blocks requests hold, the blocks of its pool."""

    group: str
    used: int
    total: int


def read_at_hits(group: BlockGroup, index: int, block_size: int, step: int) -> bool:
    """Whether a sequence resuming at a multiple of `step` (a prefix-cache hit) may read block
    `index` of `group`: every block without a window; with one, only those in the window before
    such a position (what a hit there takes from the cache: the rest are never worth keeping)."""
    if group.window is None:
        return True
    hit = -(-(index + 1) * block_size // step) * step  # the first such position after the block
    return group.dead_blocks(hit, block_size) <= index


class GroupedBlocks:
    """`num_blocks[g]` blocks of `block_size` rows for each group `groups[g]`.

    With prefix caching a block may also be registered under a content hash (`register`) and
    shared by several tables (a reference count per block). A block no table holds goes back to
    its group's free list, which is the eviction order, as in `BlockManager`: blocks holding
    nothing findable first, then cached ones least recently given back first; a cached one stays
    findable (`find`) until it is taken for something else. A window block given back as its
    request advances counts as given back too, so a later request sharing the prefix finds it."""

    def __init__(self, groups: Sequence[GroupKey], num_blocks: Sequence[int], block_size: int) -> None:
        if len(groups) != len(num_blocks) or min(num_blocks, default=1) < 1 or block_size < 1:
            raise ValueError(f"one count of at least 1 per group and a block size of at least 1: {num_blocks}")
        self.block_size = block_size
        self.groups = {key: BlockGroup(*key) for key in groups}
        self._free = {key: OrderedDict.fromkeys(range(n)) for key, n in zip(groups, num_blocks, strict=True)}
        self._refs = {key: [0] * n for key, n in zip(groups, num_blocks, strict=True)}
        self._by_hash: dict[GroupKey, dict[BlockHash, int]] = {key: {} for key in groups}
        self._hash_of: dict[GroupKey, dict[int, BlockHash]] = {key: {} for key in groups}
        self._tables: dict[str, dict[GroupKey, list[int]]] = {}

    def num_free(self, key: GroupKey) -> int:
        return len(self._free[key])

    @property
    def num_cached(self) -> int:
        """Blocks findable by their content, every group's, in use or not."""
        return sum(map(len, self._by_hash.values()))

    def tables(self, request_id: str) -> dict[GroupKey, list[int]]:
        return self._tables.get(request_id, {key: [] for key in self.groups})

    def find(self, key: GroupKey, block_hash: BlockHash) -> int | None:
        """Group `key`'s block registered under `block_hash`, if it is still held or not yet evicted."""
        return self._by_hash[key].get(block_hash)

    def register(self, key: GroupKey, block_id: int, block_hash: BlockHash) -> None:
        """Make a full block findable by its content; one whose content another block already
        holds (computed alongside) stays private, and is taken first once given back."""
        if block_hash not in self._by_hash[key] and block_id not in self._hash_of[key]:
            self._by_hash[key][block_hash] = block_id
            self._hash_of[key][block_id] = block_hash

    def allocate(
        self,
        request_id: str,
        start: int,
        num_new_tokens: int,
        cached: Mapping[GroupKey, Sequence[int]] | None = None,
    ) -> bool:
        """Tables covering positions `[0, start + num_new_tokens)` of a request whose queries now
        begin at `start` (window blocks behind it given back); False, taking nothing, when any
        group's free list is too short. `cached`: for a request holding nothing yet, the tables
        of a prefix-cache hit at `start` (`RELEASED` where the window needs nothing), which its
        tables then begin with."""
        if cached is not None and request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks; cached ones are for admission")
        tables = {key: list(table) for key, table in cached.items()} if cached else self.tables(request_id)
        for key, g in self.groups.items():  # a load resuming past its tables never takes blocks dead there
            tables[key].extend([RELEASED] * (g.dead_blocks(start, self.block_size) - len(tables[key])))
        end = start + num_new_tokens
        needed = {key: max(0, g.blocks_for(end, self.block_size) - len(tables[key])) for key, g in self.groups.items()}
        dead = {
            key: [i for i in range(g.dead_blocks(start, self.block_size)) if tables[key][i] != RELEASED]
            for key, g in self.groups.items()
        }
        shared = {key: [b for b in table if b != RELEASED] for key, table in cached.items()} if cached else {}
        for key, n in needed.items():
            refs = self._refs[key]
            revived = sum(1 for b in shared.get(key, ()) if not refs[b])  # cached, nobody holds it
            freed = sum(1 for i in dead[key] if refs[tables[key][i]] == 1)
            if n + revived > len(self._free[key]) + freed:
                return False
        for key, n in needed.items():
            for block_id in shared.get(key, ()):
                if not self._refs[key][block_id]:
                    del self._free[key][block_id]
                self._refs[key][block_id] += 1
            for i in dead[key]:  # before growing, which can take them (last, if they are cached)
                self._release(key, tables[key][i])
                tables[key][i] = RELEASED
            tables[key].extend(self._take(key) for _ in range(n))
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
                    self._release(key, block)

    def free(self, request_id: str) -> None:
        """Give back every block the request holds, tail first (a shared head is evicted last); a
        second call is a no-op."""
        for key, table in self._tables.pop(request_id, {}).items():
            for block_id in reversed(table):
                if block_id != RELEASED:
                    self._release(key, block_id)

    def pin(self, key: GroupKey, block_id: int) -> None:
        """One more reference on a block of group `key`, held by a transfer rather than a table
        (so never evicted); a cached block nobody holds comes off the free list."""
        if not self._refs[key][block_id]:
            del self._free[key][block_id]
        self._refs[key][block_id] += 1

    def unpin(self, key: GroupKey, block_id: int) -> None:
        self._release(key, block_id)

    def _take(self, key: GroupKey) -> int:
        """The first block of group `key`'s eviction order, its cached content forgotten."""
        block_id, _ = self._free[key].popitem(last=False)
        block_hash = self._hash_of[key].pop(block_id, None)
        if block_hash is not None:
            del self._by_hash[key][block_hash]
        self._refs[key][block_id] = 1
        return block_id

    def _release(self, key: GroupKey, block_id: int) -> None:
        refs = self._refs[key]
        if refs[block_id] < 1:
            raise RuntimeError(f"block {block_id} of group {key} given back but not in use (double free)")
        refs[block_id] -= 1
        if not refs[block_id]:
            self._free[key][block_id] = None
            if block_id not in self._hash_of[key]:
                self._free[key].move_to_end(block_id, last=False)  # holds nothing findable: reuse it first


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


@dataclass(frozen=True)
class PrefixHit:
    """A prefix-cache hit of a model with several groups: the request resumes at position
    `num_tokens` with these tables (`RELEASED` where its window needs nothing). Its length is the
    token blocks it covers, as `BlockManager.lookup`'s list of blocks, so the scheduler counts
    both alike (cached tokens, the saved state at its end, data-parallel routing)."""

    num_tokens: int = 0
    block_size: int = 1
    tables: Mapping[GroupKey, tuple[int, ...]] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.num_tokens // self.block_size


class GroupedBlockManager:
    """`BlockManager`'s part the scheduler calls, over one `GroupedBlocks`: a request's table per
    group instead of `Request.block_ids`. Block counts (`num_blocks`, free, used) are the groups'
    together, for the usage gauge and data-parallel routing; `group_blocks` each group's.

    Prefix caching: block i of a group is registered under the token hash chain's (`block_hash`)
    hash at the position where it ends, `(i + 1) x block_size x tokens_per_entry`, keyed by group.
    A hit resumes at a position P that ends a block of every group (a multiple of
    `hit_alignment`), so every block before P is full and shared as it is, and where the open
    compression windows' states were saved (`SavedStates`, addressed by the hash at P, as for Gated
    DeltaNets): each compressed group needs its blocks before P, the window group only those its
    window reads from P. The longest such P before the prompt's last token wins."""

    has_state = True

    def __init__(
        self,
        groups: Sequence[GroupKey],
        num_blocks: Sequence[int],
        block_size: int,
        enable_caching: bool = False,
        num_saved_states: int = 0,
    ) -> None:
        self.blocks = GroupedBlocks(groups, num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = sum(num_blocks)
        self._pools = tuple(zip(group_names(tuple(groups)), groups, num_blocks, strict=True))
        self.enable_caching = enable_caching
        self.saved_states = SavedStates(num_saved_states if enable_caching else 0)
        self.hit_alignment = block_size * lcm(*(tokens_per_entry for tokens_per_entry, _ in groups))
        """Where a hit may resume: a block boundary of every group."""

    @property
    def num_free_blocks(self) -> int:
        return sum(self.blocks.num_free(key) for key in self.blocks.groups)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.blocks.num_cached

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

    def lookup(self, request: Request) -> PrefixHit:
        """The longest hit for a request about to be admitted (empty without one), never reaching
        its last token; takes nothing: pass it to `allocate` before any other block is taken.
        A request asking for prompt logprobs takes none, as with one group."""
        if not self.saved_states.num_slots or request.sampling_params.prompt_logprobs is not None:
            return PrefixHit()
        size, step = self.block_size, self.hit_alignment
        hashes = block_hashes(request, size, (request.num_tokens - 1) // step * step // size)
        for end in range(len(hashes) * size // step * step, 0, -step):
            if hashes[end // size - 1] in self.saved_states:
                tables = self._cached_tables(hashes, end)
                if tables is not None:
                    return PrefixHit(end, size, tables)
        return PrefixHit()

    def _cached_tables(self, hashes: Sequence[BlockHash], end: int) -> dict[GroupKey, tuple[int, ...]] | None:
        """Every group's cached blocks a sequence resuming at `end` reads (`RELEASED` before its
        window), or None when any is missing. `hashes`: the token blocks' chain up to `end`."""
        tables = {}
        for key, group in self.blocks.groups.items():
            first, per_block = group.dead_blocks(end, self.block_size), group.tokens_per_entry
            found = [
                self.blocks.find(key, hashes[(i + 1) * per_block - 1])
                for i in range(first, end // (self.block_size * per_block))
            ]
            if None in found:
                return None
            tables[key] = (RELEASED,) * first + tuple(found)
        return tables

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: PrefixHit | Sequence[int] = ()) -> bool:
        """Every group's table covering the request's next `num_new_tokens` positions, all or
        nothing; with a hit from `lookup` (admission), after the hit's tables (the caller sets
        `num_computed_tokens` to its end)."""
        if not cached_blocks:
            return self.blocks.allocate(request.request_id, request.num_computed_tokens, num_new_tokens)
        if not isinstance(cached_blocks, PrefixHit) or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r}: a hit from lookup is for admission only")
        return self.blocks.allocate(request.request_id, cached_blocks.num_tokens, num_new_tokens, cached_blocks.tables)

    def free(self, request: Request) -> None:
        """Every group's blocks back, the cached ones still findable."""
        self.blocks.free(request.request_id)

    def cache_full_blocks(self, request: Request, num_computed_before: int) -> None:
        """Register the blocks of every group a step completed: those full at
        `request.num_computed_tokens` that were not at `num_computed_before`, but of a window
        group only those a hit reads (`read_at_hits`): the others, given back as the window
        moves, are taken first, so the few a hit needs outlast them in the small window pool."""
        if not self.enable_caching:
            return
        size, num_computed = self.block_size, request.num_computed_tokens
        hashes = block_hashes(request, size, num_computed // size)
        for key, table in self.blocks.tables(request.request_id).items():
            group = self.blocks.groups[key]
            per_block = group.tokens_per_entry
            for i in range(num_computed_before // (size * per_block), num_computed // (size * per_block)):
                if table[i] != RELEASED and read_at_hits(group, i, size, self.hit_alignment):
                    self.blocks.register(key, table[i], hashes[(i + 1) * per_block - 1])

    def saved_state(self, request: Request, num_blocks: int) -> int:
        """The saved-state slot of the hit `lookup` found, ending `num_blocks` token blocks in
        (made the most recently used)."""
        return self.saved_states.use(block_hashes(request, self.block_size, num_blocks)[num_blocks - 1])

    def save_state(self, request: Request, num_tokens: int) -> int | None:
        """A saved-state slot for `request`'s open windows after its first `num_tokens` positions,
        which the planned step computes; None where no hit can resume (not a multiple of
        `hit_alignment`), where that state is saved already or no slot can take it."""
        if not self.saved_states.num_slots or not num_tokens or num_tokens % self.hit_alignment:
            return None
        num_blocks = num_tokens // self.block_size
        return self.saved_states.reserve(block_hashes(request, self.block_size, num_blocks)[num_blocks - 1])

    def commit_saved_states(self) -> None:
        """The planned step ran: the states it saved are findable."""
        self.saved_states.commit()

    def drop_pending_states(self) -> None:
        """The planned step was lost: the slots reserved for its saves go back."""
        self.saved_states.drop_pending()

    def trim(self, request: Request, num_tokens: int) -> None:
        """Every group's blocks past the request's first `num_tokens` positions given back (rejected drafts')."""
        self.blocks.trim(request.request_id, num_tokens)

    def hold_prompt(self, request: Request, mark: int) -> tuple[GroupBlockIds, int]:
        """Pin what a decode instance needs to resume `request` at `mark` (a multiple of
        `hit_alignment`; a finished prefill-only request): every group's blocks it reads there, as
        a hit would (`RELEASED` before the window), and the saved-state slot of the open windows
        at `mark`. Nothing (empty tables, -1) where no hit could resume there: the prompt is
        shorter than an alignment, or its blocks or state were not cached."""
        if mark and self.saved_states.num_slots:
            num_blocks = mark // self.block_size
            hashes = block_hashes(request, self.block_size, num_blocks)
            tables = self._cached_tables(hashes, mark) if hashes[-1] in self.saved_states else None
            if tables is not None:
                held = tuple(tables.values())
                self.pin(held)
                slot = self.saved_states.pin(hashes[-1])
                assert slot is not None, "the saved state was found just now"
                return held, slot
        return tuple(() for _ in self.blocks.groups), -1

    def allocate_load(self, request: Request, mark: int, hit: PrefixHit) -> GroupBlockIds | None:
        """Admit `request` to receive its prompt's KV up to `mark` from another instance: tables
        beginning with `hit` (from `lookup`, at most `mark`) and fresh blocks for the rest, but
        none of a window group's dead at `mark`. Returns the blocks the transfer writes, per group
        (`RELEASED` at the hit's and the window's dead entries), or None, taking nothing, when
        too few blocks are free."""
        if not self.blocks.allocate(request.request_id, mark, 0, hit.tables or None):
            return None
        hit_tables = hit.tables or {key: () for key in self.blocks.groups}
        return tuple(
            tuple(RELEASED if i < len(hit_tables[key]) else b for i, b in enumerate(table))
            for key, table in self.blocks.tables(request.request_id).items()
        )

    def reserve_state_load(self, request: Request, num_blocks: int) -> int:
        """A saved-state slot for a transfer to write the open windows' state after `request`'s
        first `num_blocks` token blocks into (`saved_states.end_load` once it ends), or -1."""
        return reserve_load_slot(self.saved_states, request, self.block_size, num_blocks)

    def pin(self, group_block_ids: GroupBlockIds) -> None:
        """Hold blocks for a transfer (per group, `RELEASED` skipped) until `unpin`."""
        for key, block_ids in zip(self.blocks.groups, group_block_ids, strict=True):
            for block_id in block_ids:
                if block_id != RELEASED:
                    self.blocks.pin(key, block_id)

    def unpin(self, group_block_ids: GroupBlockIds) -> None:
        for key, block_ids in zip(self.blocks.groups, group_block_ids, strict=True):
            for block_id in reversed(block_ids):
                if block_id != RELEASED:
                    self.blocks.unpin(key, block_id)
