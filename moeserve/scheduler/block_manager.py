"""Paged KV cache bookkeeping: which fixed-size blocks of the cache each request uses, and, with
prefix caching, which blocks hold which content.

The scheduler only hands out block ids; the engine's KV cache tensors are indexed by them.

Prefix caching (vLLM's automatic prefix caching, in outline): once a step has computed a full
block, the block is registered under its content hash (`block_hash`), and a request admitted
later whose tokens begin with the same full blocks takes those blocks instead of computing them
again. A block has a reference count (the requests whose tables hold it); at zero it goes back to
the free list but keeps its hash, so it can still be found until its space is needed. The free
list is the eviction order: blocks holding nothing findable are taken first, then cached ones in
least recently released order (a request's blocks are released tail first, so a shared head goes
last). A block in use is never on the free list, so it is never evicted; a request only ever
writes positions past the cached ones it was given, so a shared block is never written.

A model whose layers keep a state per sequence (`has_state`: Gated DeltaNet) resumes a hit only
from a state saved at its last block's end (`saved_states.py`): the run of cached blocks is cut
back to the longest one ending where a saved state exists. The saved states have their own slots
and LRU order beside the blocks'; the blocks know nothing of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from moeserve.cache_spec import BlockGroup
from moeserve.scheduler.block_groups import GroupBlocks
from moeserve.scheduler.block_hash import BlockHash, block_hashes
from moeserve.scheduler.config import blocks_for_tokens
from moeserve.scheduler.request import Request
from moeserve.scheduler.saved_states import SavedStates, reserve_load_slot


class BlockManager:
    """`num_blocks` block ids of `block_size` tokens each; `enable_caching` turns prefix caching on.
    `has_state`: the model's sequences also keep a state, of which prefix caching holds up to
    `num_saved_states` saved ones."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        has_state: bool = False,
        num_saved_states: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order, first out first
        self._ref_counts = [0] * num_blocks
        self._block_by_hash: dict[BlockHash, int] = {}
        self._hash_by_block: dict[int, BlockHash] = {}
        self.has_state = has_state
        self.saved_states = SavedStates(num_saved_states if has_state and enable_caching else 0)
        self.hit_alignment = block_size
        """Where a hit may resume: any block boundary (`GroupedBlockManager` has a coarser one)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted when needed)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by their content, in use or not."""
        return len(self._block_by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for the KV-usage gauge in /metrics."""
        return self.num_used_blocks / self.num_blocks

    @property
    def group_blocks(self) -> tuple[GroupBlocks, ...]:
        """Its one group's usage, for /metrics: `full` (a block per `block_size` positions, none
        given back behind a window; `BlockGroup.name`)."""
        return (GroupBlocks(BlockGroup().name, self.num_used_blocks, self.num_blocks),)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` lacks to hold positions `[0, num_computed_tokens + num_new_tokens)`."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - len(request.block_ids))

    def group_tables(self, request: Request) -> dict:
        """None beside `request.block_ids`: one group, one table (`GroupedBlockManager` has several)."""
        return {}

    def lookup(self, request: Request) -> list[int]:
        """The cached blocks holding the longest run of `request`'s full blocks from its start,
        for a request about to be admitted. The run stops short of the last token, whose logits
        the request needs, so at least one token is always computed. Takes nothing: pass the
        result to `allocate` before any other block is taken. A request that asked for prompt
        logprobs takes nothing either (as in vLLM): they need every prompt position computed.
        With `has_state` the run ends where a saved state exists (`saved_state`), or is empty."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        found = []
        hashes = block_hashes(request, self.block_size, (request.num_tokens - 1) // self.block_size)
        for block_hash in hashes:
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        if self.has_state:
            while found and hashes[len(found) - 1] not in self.saved_states:
                found.pop()
        return found

    def saved_state(self, request: Request, num_blocks: int) -> int:
        """The saved-state slot holding `request`'s state after its first `num_blocks` blocks, a
        hit `lookup` found (made the most recently used): the request resumes from a copy of it."""
        return self.saved_states.use(block_hashes(request, self.block_size, num_blocks)[num_blocks - 1])

    def save_state(self, request: Request, num_tokens: int) -> int | None:
        """A saved-state slot for `request`'s state after its first `num_tokens` positions (a
        whole number of blocks), which the planned step computes; None if that state is already
        saved or no slot can take it. Findable once the step has run (`commit_saved_states`)."""
        num_blocks = num_tokens // self.block_size
        if not self.saved_states.num_slots or not num_blocks or num_tokens % self.block_size:
            return None
        return self.saved_states.reserve(block_hashes(request, self.block_size, num_blocks)[num_blocks - 1])

    def pin_saved_state(self, request: Request, num_blocks: int) -> int:
        """The saved-state slot holding `request`'s state after its first `num_blocks` blocks,
        pinned for a transfer to read (`saved_states.unpin`), or -1 when none is held."""
        if not num_blocks or not self.saved_states.num_slots:
            return -1
        slot = self.saved_states.pin(block_hashes(request, self.block_size, num_blocks)[num_blocks - 1])
        return -1 if slot is None else slot

    def reserve_state_load(self, request: Request, num_blocks: int) -> int:
        """A saved-state slot for a transfer to write `request`'s state after its first
        `num_blocks` blocks into (`saved_states.end_load` once it ends), or -1 when none is taken."""
        return reserve_load_slot(self.saved_states, request, self.block_size, num_blocks)

    def commit_saved_states(self) -> None:
        """The planned step ran: the states it saved are findable."""
        self.saved_states.commit()

    def drop_pending_states(self) -> None:
        """The planned step was lost: the slots reserved for its saves go back."""
        self.saved_states.drop_pending()

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Extend `request.block_ids` to cover its next `num_new_tokens` tokens.

        `cached_blocks`, from `lookup`, is only for a request that holds no blocks yet: its table
        then begins with them and its new tokens start right after them (the caller sets
        `num_computed_tokens` to match). All or nothing: when the free list is too short nothing
        is taken and False is returned, so a caller that then preempts someone can try again.
        """
        num_held_tokens = len(request.block_ids) * self.block_size
        if not cached_blocks and request.num_computed_tokens + num_new_tokens <= num_held_tokens:
            return True  # the blocks it holds have room: a decode step's usual case
        if cached_blocks and (request.block_ids or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id!r} already holds blocks; cached blocks are for admission")
        num_tokens = len(cached_blocks) * self.block_size + request.num_computed_tokens + num_new_tokens
        num_held = len(request.block_ids) + len(cached_blocks)
        num_needed = max(0, blocks_for_tokens(num_tokens, self.block_size) - num_held)
        num_revived = sum(1 for block_id in cached_blocks if self._ref_counts[block_id] == 0)
        if num_needed + num_revived > len(self._free):
            return False
        for block_id in cached_blocks:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(cached_blocks)
        request.block_ids.extend(self._take_free_block() for _ in range(num_needed))
        return True

    def cache_full_blocks(self, request: Request, num_computed_before: int) -> None:
        """Register the blocks a step completed: those full at `request.num_computed_tokens` that
        were not at `num_computed_before`. Only full, computed blocks are findable, so a block
        being filled by a chunked prefill or by decodes is never handed to anyone. A block whose
        content is already cached (a copy computed alongside, or the block recomputed for a last
        token) stays private and is taken first once freed."""
        first = num_computed_before // self.block_size
        if not self.enable_caching or request.num_computed_tokens // self.block_size == first:
            return  # no block was completed
        hashes = block_hashes(request, self.block_size, request.num_computed_tokens // self.block_size)
        for index in range(first, len(hashes)):
            block_hash, block_id = hashes[index], request.block_ids[index]
            if block_hash not in self._block_by_hash:
                self._block_by_hash[block_hash] = block_id
                self._hash_by_block[block_id] = block_hash

    def free(self, request: Request) -> None:
        """Release all of `request`'s blocks and clear its block table; a second call is a no-op.

        The tail goes back first, so the head blocks (a shared prefix) are the last evicted.
        """
        for block_id in reversed(request.block_ids):
            self._release_block(block_id)
        request.block_ids.clear()

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks of `request`'s table past the first `num_tokens` positions, tail
        first: those taken for draft tokens the target rejected. They hold no verified token, so
        none is cached; they go back as blocks holding nothing findable."""
        keep = blocks_for_tokens(num_tokens, self.block_size)
        while len(request.block_ids) > keep:
            self._release_block(request.block_ids.pop())

    def pin(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on blocks, so they outlive their request: a prefill
        instance's blocks held for a transfer, a decode instance's blocks a transfer writes into
        until it is known to be over. Pinned blocks are never evicted, hence never handed to
        anyone else. A cached block nobody holds comes off the free list, as on admission."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def hold_prompt(self, request: Request, mark: int) -> tuple[list[int], int]:
        """Pin what a decode instance needs to resume `request` at `mark` (a block boundary; a
        finished prefill-only request): its blocks before it, and with state layers the saved
        state there (-1 when none is held)."""
        held = request.block_ids[: mark // self.block_size]
        self.pin(held)
        return held, self.pin_saved_state(request, len(held)) if self.has_state else -1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Give back the references `pin` took."""
        for block_id in reversed(block_ids):
            self._release_block(block_id)

    def _take_free_block(self) -> int:
        """The first block of the eviction order, its cached content forgotten."""
        block_id, _ = self._free.popitem(last=False)
        block_hash = self._hash_by_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_by_hash[block_hash]
        self._ref_counts[block_id] = 1
        return block_id

    def _release_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks or self._ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} freed but not in use (double free or foreign id)")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if block_id not in self._hash_by_block:
                self._free.move_to_end(block_id, last=False)  # holds nothing findable: reuse it first
