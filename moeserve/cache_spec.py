"""What each layer keeps between steps, declared by the layer, read by everyone who sizes, hands
out or moves cache (see docs/architecture.md, "Cache specs").

Two kinds, both torch-free so the scheduler and `moeserve plan` read them without a model:

- `PagedSpec`: entries that grow with the context, kept in the block pool; paged specs with the
  same (tokens per entry, window) form a group that shares one block table (a block id covers
  `block_size` entries in each of them). Full attention's K and V, MLA's latent and DSA's
  indexer keys are paged, one entry per position, in the one group today's models have.
- `StateSpec`: tensors of a fixed size per sequence whatever its length (Gated DeltaNet's conv
  and recurrent states, DeepSeek-V4's open compression window), held in one slot per running
  sequence.

A layer that keeps several tensors declares them as a tuple (a DSA layer: its MLA latent and its
indexer keys; a DeepSeek-V4 layer: its window, compressed entries, indexer keys and open window).

`CacheSpecs` is the model's list, one entry per layer (the MTP layers' after the decoder's).
`BlockGroup` is the rule of one block-table group, what the block manager hands out and the
planner prices by the same count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}  # uint8: packed bytes (FP8 indexer keys)

GroupKey = tuple[int, int | None]
"""A block-table group's (tokens per entry, window): `PagedSpec.group_key`."""


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
    def group_key(self) -> GroupKey:
        return self.tokens_per_entry, self.window

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one entry (one position's when `tokens_per_entry` is 1)."""
        return math.prod(self.leading) * math.prod(self.per_token) * ITEMSIZES[self.dtype]


@dataclass(frozen=True)
class BlockGroup:
    """What a request holds of one group's blocks. A table indexes absolute rows: block i holds
    rows `i * block_size ..`, a row being one position or one closed window of
    `tokens_per_entry` positions; a window group's blocks wholly behind the window go back."""

    tokens_per_entry: int = 1
    window: int | None = None

    @property
    def name(self) -> str:
        """Its name in /metrics (the `group` label): `full` (one entry per position, no window),
        `window`, or `compressed_<tokens per entry>`."""
        if self.window is not None:
            return "window" if self.tokens_per_entry == 1 else f"compressed_{self.tokens_per_entry}_window"
        return "full" if self.tokens_per_entry == 1 else f"compressed_{self.tokens_per_entry}"

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks holding the rows of a request's first `num_tokens` positions."""
        return -(-(num_tokens // self.tokens_per_entry) // block_size)

    def dead_blocks(self, start: int, block_size: int) -> int:
        """Leading blocks no query from position `start` on reads: behind the window (0 without one)."""
        if self.window is None:
            return 0
        return max(0, start - self.window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request of `num_tokens` positions holds once its last one is computed (the
        step that computed it gave back what lies wholly behind its window)."""
        return self.blocks_for(num_tokens, block_size) - self.dead_blocks(num_tokens - 1, block_size)


def group_names(keys: tuple[GroupKey, ...]) -> tuple[str, ...]:
    """Each group's `BlockGroup.name`; ValueError when two share one (two windows), since the
    names label /metrics series."""
    names = tuple(BlockGroup(*key).name for key in keys)
    if len(set(names)) != len(names):
        raise ValueError(f"block-table groups {keys} do not have distinct names: {names}")
    return names


@dataclass(frozen=True)
class StateSpec:
    """A layer's per-sequence state: tensor i is `(num_slots,) + shapes[i]` in `dtypes[i]` (Gated
    DeltaNet: the conv state in the model's dtype, the recurrent state in float32); this rank's share."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @property
    def bytes_per_sequence(self) -> int:
        return sum(math.prod(s) * ITEMSIZES[d] for s, d in zip(self.shapes, self.dtypes, strict=True))


Spec = PagedSpec | StateSpec
LayerSpec = Spec | tuple[Spec, ...]


@dataclass(frozen=True)
class CacheSpecs:
    layers: tuple[LayerSpec, ...]

    @property
    def specs(self) -> tuple[Spec, ...]:
        """Every spec of every layer, a layer's several in their order."""
        return tuple(p for s in self.layers for p in (s if isinstance(s, tuple) else (s,)))

    @property
    def paged(self) -> tuple[PagedSpec, ...]:
        """Every paged tensor of every layer, a layer's several in their order."""
        return tuple(s for s in self.specs if isinstance(s, PagedSpec))

    @property
    def groups(self) -> tuple[GroupKey, ...]:
        """The block-table groups the paged specs form (`PagedSpec.group_key`), in first-seen order."""
        return tuple(dict.fromkeys(s.group_key for s in self.paged))

    @property
    def has_state(self) -> bool:
        """Whether a sequence's cache includes a state: such a sequence starts from position 0 or
        from a saved state (a prefix-cache hit), and steps back past rejected drafts only to a
        state kept for it."""
        return any(isinstance(s, StateSpec) for s in self.specs)

    def bytes_per_block(self, block_size: int) -> int:
        """One block id's bytes: its `block_size` entries in every paged tensor."""
        return block_size * sum(s.bytes_per_token for s in self.paged)

    def group_bytes_per_block(self, block_size: int) -> tuple[int, ...]:
        """One block id's bytes in each group (`groups`' order): its entries in the group's tensors."""
        return tuple(block_size * sum(s.bytes_per_token for s in self.paged if s.group_key == g) for g in self.groups)

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(s.bytes_per_sequence for s in self.specs if isinstance(s, StateSpec))

    @property
    def bytes_per_context_token(self) -> float:
        """What each further position of context adds, in the long run: every paged tensor
        without a window, an entry's bytes per `tokens_per_entry` positions (a window's bytes
        stop growing at the window)."""
        return sum(s.bytes_per_token / s.tokens_per_entry for s in self.paged if s.window is None)

    def bytes_per_sequence(self, num_tokens: int, block_size: int) -> int:
        """A sequence of `num_tokens` positions: the blocks it holds in each group
        (`BlockGroup.blocks_held`) and its state."""
        held = (BlockGroup(*key).blocks_held(num_tokens, block_size) for key in self.groups)
        paged = sum(n * b for n, b in zip(held, self.group_bytes_per_block(block_size), strict=True))
        return paged + self.state_bytes_per_sequence
