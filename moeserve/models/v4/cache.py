"""DeepSeek-V4's cache, declared as specs, and how a step reads and writes it.

Per layer: the window's keys (one `head_dim` row per position, `PagedSpec` with `window`: only the
last `window` positions are read, so blocks behind them can go back); on a compressed layer its
entries (one row per `ratio` positions, `tokens_per_entry`), on a CSA layer the indexer's keys
too (the same group); and the open compression window as a state (`StateSpec`): the projected
values and raw gates of the up to `ratio - 1` positions not yet pooled, and on a CSA layer the
last closed window's Ca values and biased gates its next entry pools with (the indexer's alike).

Drafts: a verify step feeds 1 + k tokens, and a window it closes may hold rejected ones. Rather
than keep the open window after each fed position (1 + k states per sequence), each compressor
keeps the step's inputs (`LayerCache.kept`): the values and gates of the window's positions
before the step and of the fed ones, and its carry before the step. The next step rebuilds the
open window after the last accepted token from them (`Compressor.step_back`); an entry pooled
from rejected tokens is rewritten, before any query reads it, when the right tokens close its
window.

A step hands each sequence's block table per group (keyed by `PagedSpec.group_key`) and its
state slot (`SequenceView`); the tables index absolute rows: row i of a group lies in block
`table[i // block_size]` at `i % block_size`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from moeserve.cache_spec import CacheSpecs, PagedSpec, Spec, StateSpec
from moeserve.config import DTYPES, ModelConfig
from moeserve.engine_config import dtype_name


def layer_specs(cfg: ModelConfig, layer: int, dtype: torch.dtype) -> tuple[Spec, ...]:
    """Layer `layer`'s specs: the window's, then the entries' and the indexer keys' (compressed
    layers; CSA for the keys), then the open window's state (compressed layers). An MTP block
    (`layer` past the decoder's) has the window's alone, in the decoder's window group."""
    ca = cfg.compressed_attention
    assert ca is not None
    name, ratio, hd = dtype_name(dtype), ca.ratio(layer), cfg.head_dim
    specs: list[Spec] = [PagedSpec((), (hd,), name, window=ca.window)]
    if not ratio:
        return tuple(specs)
    specs.append(PagedSpec((), (hd,), name, tokens_per_entry=ratio))
    sparse = ratio == ca.sparse_ratio
    state = _open_window(ratio, hd, sparse, name)
    if sparse:
        specs.append(PagedSpec((), (ca.index_head_dim,), name, tokens_per_entry=ratio))
        state = StateSpec(
            state.shapes + _open_window(ratio, ca.index_head_dim, True, name).shapes,
            state.dtypes + _open_window(ratio, ca.index_head_dim, True, name).dtypes,
        )
    specs.append(state)
    return tuple(specs)


def _open_window(ratio: int, head_dim: int, overlap: bool, dtype: str) -> StateSpec:
    """A compressor's pending values and gates `[ratio - 1, width]`, with overlap its carry `[ratio, head_dim]` x 2."""
    width = 2 * head_dim if overlap else head_dim
    shapes: tuple[tuple[int, ...], ...] = ((ratio - 1, width), (ratio - 1, width))
    dtypes: tuple[str, ...] = (dtype, dtype)
    if overlap:
        shapes, dtypes = shapes + ((ratio, head_dim), (ratio, head_dim)), dtypes + (dtype, "float32")
    return StateSpec(shapes, dtypes)


@dataclass(frozen=True)
class LayerCache:
    """One layer's tensors, allocated from `layer_specs`: the window `[N, B, D]`, the entries and
    indexer keys (None where the layer has none), the open-window state's tensors (slot-major),
    as many again for prefix caching's saved states (`saved`, saved-slot-major) and, with drafts,
    what a verify step keeps to step back (`kept`: the state's tensors, the pending ones with room
    for the step's 1 + k positions besides). `paged_groups`: the block-table group of each paged
    tensor (its index among the model's groups), which a KV transfer moves with that group's block
    ids."""

    window: torch.Tensor
    entries: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    state: tuple[torch.Tensor, ...] = ()
    saved: tuple[torch.Tensor, ...] = ()
    kept: tuple[torch.Tensor, ...] = ()
    paged_groups: tuple[int, ...] = ()

    def load_saved(self, slots: Sequence[int], saved: Sequence[int]) -> None:
        """Sequence slots `slots` start from the saved states `saved` (a prefix-cache hit)."""
        for live, kept in zip(self.state, self.saved, strict=True):
            live[_index(slots, live)] = kept[_index(saved, live)]

    def save(self, slots: Sequence[int], saved: Sequence[int]) -> None:
        """Copy the states of sequence slots `slots` into saved-state slots `saved`."""
        for live, kept in zip(self.state, self.saved, strict=True):
            kept[_index(saved, live)] = live[_index(slots, live)]

    @property
    def paged(self) -> tuple[torch.Tensor, ...]:
        """The paged tensors: the window's, then the entries' and indexer keys' where present."""
        return tuple(t for t in (self.window, self.entries, self.index_keys) if t is not None)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the layer holds (its paged ones, then its state's)."""
        return self.paged + self.state


def _index(slots: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """Slot numbers as an index tensor on `like`'s device."""
    return torch.tensor(slots, dtype=torch.int64, device=like.device)


def allocate(
    specs: tuple[Spec, ...],
    num_blocks: Mapping[tuple[int, int | None], int],
    block_size: int,
    num_slots: int,
    device: torch.device | str = "cpu",
    num_saved: int = 0,
    draft_states: int = 0,
) -> LayerCache:
    """Zeroed tensors for one layer's specs, each paged one with its group's `num_blocks[group_key]`
    (keyed in the model's groups' order), its state for `num_slots` sequences and `num_saved` saved
    states; with `draft_states` (1 + k drafts: the tokens of a verify step), the `kept` tensors too."""
    paged_specs = [s for s in specs if isinstance(s, PagedSpec)]
    paged = [
        torch.zeros(s.shape(num_blocks[s.group_key], block_size), dtype=DTYPES[s.dtype], device=device)
        for s in paged_specs
    ]
    groups = tuple(list(num_blocks).index(s.group_key) for s in paged_specs)
    state = next((s for s in specs if isinstance(s, StateSpec)), None)
    if state is None:
        return LayerCache(*paged, *([None] * (3 - len(paged))), paged_groups=groups)

    def states(count: int, shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
        if not count:
            return ()
        return tuple(
            torch.zeros((count, *shape), dtype=DTYPES[d], device=device)
            for shape, d in zip(shapes, state.dtypes, strict=True)
        )

    kept = states(num_slots, kept_spec(state, draft_states).shapes) if draft_states else ()
    return LayerCache(
        *paged,
        *([None] * (3 - len(paged))),
        state=states(num_slots, state.shapes),
        saved=states(num_saved, state.shapes),
        kept=kept,
        paged_groups=groups,
    )


def kept_spec(state: StateSpec, draft_states: int) -> StateSpec:
    """What a compressed layer keeps of a verify step of `draft_states` (1 + k) tokens to step
    back (`LayerCache.kept`): its state's tensors, the pending ones with room for the step's
    positions besides. Each compressor's tensors come in fours (pending values, gates, then the
    carry's two) or, without overlap, twos: the pending ones are those at an index below 2 mod 4."""
    shapes = tuple((n + draft_states * (i % 4 < 2), *rest) for i, (n, *rest) in enumerate(state.shapes))
    return StateSpec(shapes, state.dtypes)


def kept_bytes_per_sequence(specs: CacheSpecs, draft_states: int) -> int:
    """Bytes a sequence's `kept` tensors take over every layer of `specs` (0 without drafts):
    about one open-window state, where a state after each fed token would take `draft_states`."""
    if not draft_states:
        return 0
    return sum(kept_spec(s, draft_states).bytes_per_sequence for s in specs.specs if isinstance(s, StateSpec))


@dataclass(frozen=True)
class SequenceView:
    """One sequence of the step: its first position, its block table per group, its state slot;
    the drafts it verifies (its last tokens) and `restore` (`StateBatch.restores`: -1, or the
    drafts the previous step accepted, fewer than it fed)."""

    start: int
    tables: dict[tuple[int, int | None], torch.Tensor]
    slot: int
    block_size: int
    drafts: int = 0
    restore: int = -1

    def table(self, spec_key: tuple[int, int | None]) -> torch.Tensor:
        return self.tables[spec_key]


@dataclass(frozen=True)
class V4Batch:
    """A step's sequences in packing order, each with its tokens' count and its cache view."""

    query_lens: tuple[int, ...]
    sequences: tuple[SequenceView, ...]


def write_rows(cache: torch.Tensor, table: torch.Tensor, first: int, rows: torch.Tensor, block_size: int) -> None:
    """Rows `first .. first + len(rows)` of a group's tensor `[N, B, D]` set to `rows`."""
    index = torch.arange(first, first + rows.shape[0])
    cache[table[index // block_size], index % block_size] = rows.to(cache.dtype)
