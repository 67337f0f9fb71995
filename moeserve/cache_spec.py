"""What each layer keeps between steps, declared by the layer, read by everyone who sizes, hands
out or moves cache (see docs/architecture.md, "Cache specs").

Two kinds, both torch-free so the scheduler and `moeserve plan` read them without a model:

- `PagedSpec`: entries that grow with the context, kept in the block pool; every paged layer of
  a model shares one block table (a block id covers `block_size` positions in each of them).
  Full attention's K and V and MLA's latent are paged.
- `StateSpec`: tensors of a fixed size per sequence whatever its length (Gated DeltaNet's conv
  and recurrent states), held in one slot per running sequence.

`CacheSpecs` is the model's list, each layer's specs in order (the MTP layers' after the decoder's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PagedSpec:
    """A layer's cache tensor is `leading + (num_blocks, block_size) + per_token` in `dtype`:
    K and V `(2,) + (..) + (Hkv, D)`, MLA's latent `() + (..) + (rank + rope,)`; this rank's share.

    `tokens_per_entry`: context positions per entry (DeepSeek-V4's compressed caches: 4 or 128),
    so a block covers `block_size x tokens_per_entry` positions. `window`: only the last `window`
    positions are ever read (V4's sliding window), so blocks wholly behind it can go back. Specs
    with the same pair share one block table (a group, `group_key`)."""

    leading: tuple[int, ...]
    per_token: tuple[int, ...]
    dtype: str
    tokens_per_entry: int = 1
    window: int | None = None

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (*self.leading, num_blocks, block_size, *self.per_token)

    @property
    def group_key(self) -> tuple[int, int | None]:
        return self.tokens_per_entry, self.window

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one entry (one position's when `tokens_per_entry` is 1)."""
        return math.prod(self.leading) * math.prod(self.per_token) * ITEMSIZES[self.dtype]


@dataclass(frozen=True)
class StateSpec:
    """A layer's per-sequence state: tensor i is `(num_slots,) + shapes[i]` in `dtypes[i]` (Gated
    DeltaNet: the conv state in the model's dtype, the recurrent state in float32); this rank's share."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def bytes_per_sequence(self) -> int:
        return sum(math.prod(s) * ITEMSIZES[d] for s, d in zip(self.shapes, self.dtypes, strict=True))


LayerSpec = PagedSpec | StateSpec


@dataclass(frozen=True)
class CacheSpecs:
    layers: tuple[LayerSpec, ...]
    """The layers' specs in model order (a DeepSeek-V4 layer declares several)."""

    @property
    def groups(self) -> tuple[tuple[int, int | None], ...]:
        """The block-table groups the paged specs form (`PagedSpec.group_key`), in first-seen order."""
        return tuple(dict.fromkeys(s.group_key for s in self.layers if isinstance(s, PagedSpec)))

    @property
    def has_state(self) -> bool:
        """Whether a sequence's cache includes a state: such a sequence can only start from
        position 0 (no prefix-cache hit, no transferred blocks) and never step back (no drafts)."""
        return any(isinstance(spec, StateSpec) for spec in self.layers)

    def bytes_per_block(self, block_size: int) -> int:
        """One block id's bytes: its `block_size` positions in every paged layer."""
        return block_size * sum(s.bytes_per_token for s in self.layers if isinstance(s, PagedSpec))

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(s.bytes_per_sequence for s in self.layers if isinstance(s, StateSpec))

    def bytes_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """A sequence of `num_tokens` positions: its whole blocks and its state."""
        return -(-num_tokens // block_size) * self.bytes_per_block(block_size) + self.state_bytes_per_sequence
