"""Content addresses of full KV blocks, for prefix caching.

Block i's KV depends on every token at positions `[0, (i + 1) * block_size)`, not only its own, so
its address is a hash chained over the previous block's hash and the block's token ids: two
sequences share block i's hash exactly when they share all tokens up to its end. Positions need no
place in the hash (block i of a chain sits at block i), and neither does the model or its dtype,
which are fixed for a cache's life. A per-request input that changed the KV without changing the
tokens (a LoRA adapter, an image, a tenant's cache salt) would have to be hashed into every block
alongside its tokens; moeserve has none yet.

sha256 from the standard library rather than Python's `hash()` or a 64-bit xxhash: a collision
would silently give a request another prompt's KV, and at about a microsecond per block the hash
costs nothing next to prefilling the block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from moeserve.scheduler.request import Request

BlockHash = bytes
"""A sha256 digest (32 bytes)."""


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The address of a full block holding `token_ids`, after the block whose address is `parent`
    (None for a sequence's first block). The first block hashes its tokens alone (8 bytes per
    token), later ones 32 more bytes of parent: the two inputs never have the same length, so a
    first block never takes a later one's address."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def block_hashes(request: Request, block_size: int, num_blocks: int) -> list[BlockHash]:
    """The chained hashes of `request`'s first `num_blocks` full blocks (fewer if its tokens do not
    fill that many), computed once: `request.block_hashes` keeps them, as a request's tokens only
    ever grow, and preemption leaves them."""
    hashes = request.block_hashes
    num_blocks = min(num_blocks, request.num_tokens // block_size)
    while len(hashes) < num_blocks:
        start = len(hashes) * block_size
        tokens = request.token_ids_between(start, start + block_size)
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
    return hashes[:num_blocks]
