"""What a step's attention is, whatever backend computes it, and the paged KV cache it runs over.

The KV cache is a pool of fixed-size blocks; each sequence owns a block table mapping its
logical block i to a physical block id. A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the flattened pool.

Attention is planned once per step and run per layer: the runner describes the step once
(`attention_batch`: per sequence its block table, start position and query length, plus the
slot each new token's K/V goes to), and the model's `LayerOps` turns that into its own
`AttentionPlan` subclass, which every layer then passes back to the same backend. A backend
derives only what its own attention needs (the torch reference: every sequence's context slots;
the Triton kernels: block tables and lengths on the device), so no backend pays for another's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve.ops.host_ints import int64_tensor


@dataclass(frozen=True)
class AttentionBatch:
    """The step's sequences as the scheduler planned them; B sequences, T tokens.

    block_tables:    per sequence, the physical block of each of its logical blocks.
    start_positions: per sequence, the position of its first token in this step (tokens cached).
    query_lens:      per sequence, how many of its tokens are in this step (they add up to T).
    block_size:      tokens per cache block.
    slot_mapping:    `[T]` int64 on the model's device, cache slot each new token's K/V is written to.
    """

    block_tables: tuple[tuple[int, ...], ...]
    start_positions: tuple[int, ...]
    query_lens: tuple[int, ...]
    block_size: int
    slot_mapping: torch.Tensor

    @property
    def context_lens(self) -> tuple[int, ...]:
        """Per sequence, its context length after this step (cached + new tokens)."""
        return tuple(start + qlen for start, qlen in zip(self.start_positions, self.query_lens))

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device


def attention_batch(
    block_tables: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionBatch:
    """The step's `AttentionBatch`: sequence i brings its tokens [start_i, start_i + query_len_i).

    Only the new tokens' slots are computed (O(T)); what a backend needs about whole contexts is
    its own plan's business.
    """
    if not len(block_tables) == len(start_positions) == len(query_lens):
        raise ValueError(
            f"block_tables, start_positions and query_lens differ in length: "
            f"{len(block_tables)}, {len(start_positions)}, {len(query_lens)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    slots: list[int] = []
    for i, (blocks, start, qlen) in enumerate(zip(block_tables, start_positions, query_lens)):
        needed = -(-(start + qlen) // block_size)
        if len(blocks) < needed:
            raise ValueError(
                f"sequence {i}: block table holds {len(blocks)} blocks, positions up to {start + qlen} need {needed}"
            )
        if qlen == 1:  # a decode: its one slot
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        else:
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, start + qlen))
    return AttentionBatch(
        block_tables=tuple(tuple(map(int, blocks)) for blocks in block_tables),
        start_positions=tuple(map(int, start_positions)),
        query_lens=tuple(map(int, query_lens)),
        block_size=block_size,
        slot_mapping=int64_tensor(slots).to(device),
    )


@dataclass(frozen=True)
class AttentionPlan:
    """What every backend's plan holds: where the step's new K/V go. A backend subclasses it
    with what its attention needs and gets its own subclass back in every attention call.

    slot_mapping: `[T]` int64, the `AttentionBatch`'s; layers write the cache with it.
    """

    slot_mapping: torch.Tensor
    selections: dict[int, Any] = field(default_factory=dict, compare=False, repr=False, kw_only=True)
    """A DSA model's top-k of this forward, by the layer that chose it (`LayerOps.dsa_select`),
    in the backend's form. Written by a layer that runs its indexer, read by it and by the layers
    that reuse its choice (GLM-5); each micro-batch of a step has its own plan, so its own."""

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


def write_to_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `values [T, ...]` at `slot_mapping [T]` of `cache [num_blocks, block_size, ...]`."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slot_mapping, values.to(cache.dtype))


def gather_from_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Read `[len(slots), ...]` entries of `cache [num_blocks, block_size, ...]`."""
    return cache.view(-1, *cache.shape[2:]).index_select(0, slots)


@dataclass(frozen=True)
class DecodeGraphInputs:
    """The persistent device buffers a captured decode step reads: B sequences of one new token
    each, whose values the runner rewrites before every replay (shapes and addresses never change).

    slot_mapping:    `[B]` int64, cache slot of each sequence's new K/V.
    block_table:     `[B, W]` int32, each sequence's physical blocks, zero-padded to W.
    context_lens:    `[B]` int32, context length after this step (cached + the new token).
    query_start:     `[B + 1]` int32, 0, 1, ..., B (one token per sequence).
    block_size:      tokens per cache block.
    max_context_len: the longest context any replay may bring (max_model_len): what sizes a
                     backend's launch grids and padded shapes, fixed at capture.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor
    block_size: int
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return self.slot_mapping.shape[0]
