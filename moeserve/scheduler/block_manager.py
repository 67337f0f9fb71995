"""Paged KV cache bookkeeping: which fixed-size blocks of the cache each request owns.

The scheduler only hands out block ids; the engine's KV cache tensors are indexed by them. Every
block has exactly one owner or is free. Prefix caching would slot in at `_take_block` /
`_release_block`: a block would then carry a content hash and a reference count, and a released
block would stay findable by its hash until it is reused.
"""

from __future__ import annotations

from collections import deque

from moeserve.scheduler.config import blocks_for_tokens
from moeserve.scheduler.request import Request


class BlockManager:
    """A free list of `num_blocks` block ids of `block_size` tokens each.

    Blocks are taken from the front of the free list and returned to its back, so a freed block is
    reused as late as possible (the order an LRU prefix cache would want).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, for the KV-usage gauge in /metrics."""
        return len(self._used) / self.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` lacks to hold positions `[0, num_computed_tokens + num_new_tokens)`."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, blocks_for_tokens(num_tokens, self.block_size) - len(request.block_ids))

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Extend `request.block_ids` to cover its next `num_new_tokens` tokens.

        All or nothing: when the free list is too short nothing is taken and False is returned,
        so a caller that then preempts someone can simply try again.
        """
        num_needed = self.blocks_needed(request, num_new_tokens)
        if num_needed > len(self._free):
            return False
        request.block_ids.extend(self._take_block() for _ in range(num_needed))
        return True

    def free(self, request: Request) -> None:
        """Return all of `request`'s blocks and clear its block table; a second call is a no-op.

        The tail goes back first, so the head blocks (a shared prefix, once prefix caching exists)
        are the last to be reused.
        """
        for block_id in reversed(request.block_ids):
            self._release_block(block_id)
        request.block_ids.clear()

    def _take_block(self) -> int:
        block_id = self._free.popleft()
        assert block_id not in self._used, f"block {block_id} handed out twice"
        self._used.add(block_id)
        return block_id

    def _release_block(self, block_id: int) -> None:
        if block_id not in self._used:
            raise RuntimeError(f"block {block_id} freed but not in use (double free or foreign id)")
        self._used.remove(block_id)
        self._free.append(block_id)
