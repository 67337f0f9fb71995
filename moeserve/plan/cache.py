"""`moeserve plan --cache-per-sequence`: what one sequence's cache costs, model beside model, from
the layers' cache specs (`CacheSpecs`, the numbers the engine budgets with), not from a formula of
the planner's own: a hybrid's fixed state beside its attention layers' paged KV shows where it
pays (long contexts) and where it does not (short ones); DeepSeek-V4's window (bounded by the
window, not the context) and entries compressed from 4 or 128 positions beside DeepSeek-V3's
latent per position show what compression buys at 1M tokens; and what each saved state prefix
caching holds costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.cache_spec import BlockGroup
from moeserve.config import ModelConfig
from moeserve.models.decoder import cache_specs
from moeserve.plan.shapes import BLOCK_SIZE

CONTEXTS = (1024, 32 * 1024, 128 * 1024, 1024 * 1024)


@dataclass(frozen=True)
class SequenceCache:
    """One model's cache bytes on one rank (TP 1), bf16 KV and conv state, float32 recurrent state."""

    name: str
    bytes_per_token: float
    """What each further position of context adds (`CacheSpecs.bytes_per_context_token`)."""
    window_bytes: int
    """The window groups' blocks a sequence holds at most: its last `window` positions, in the
    blocks they span (0 without a window)."""
    state_bytes: int
    """A sequence's states, whatever its length (0 without state layers); each saved state of
    prefix caching is a copy of them (`LinearState.save`, `models.v4.cache.LayerCache.save`)."""
    at_context: tuple[int, ...]
    """Bytes of a sequence of each of `CONTEXTS` tokens: the blocks it holds and its states."""


def sequence_cache(config: ModelConfig, name: str) -> SequenceCache:
    specs = cache_specs(config, torch.bfloat16)
    window = sum(
        b * _most_blocks(BlockGroup(*key))
        for key, b in zip(specs.groups, specs.group_bytes_per_block(BLOCK_SIZE), strict=True)
        if key[1] is not None
    )
    return SequenceCache(
        name,
        specs.bytes_per_context_token,
        window,
        specs.state_bytes_per_sequence,
        tuple(specs.bytes_per_sequence(n, BLOCK_SIZE) for n in CONTEXTS),
    )


def _most_blocks(group: BlockGroup) -> int:
    """The most blocks a window group holds past its window: its last `window` positions, in the
    blocks they span, which repeats every `BLOCK_SIZE` positions."""
    assert group.window is not None
    return max(group.blocks_held(n, BLOCK_SIZE) for n in range(group.window, group.window + BLOCK_SIZE))


def _size(num_bytes: float) -> str:
    """MiB (one decimal below 100), GiB from 10 GiB up; `-` for nothing."""
    if not num_bytes:
        return "-"
    mib = num_bytes / 2**20
    if mib >= 10 * 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.0f} MiB" if mib >= 100 or mib == int(mib) else f"{mib:.1f} MiB"


def _kib(num_bytes: float) -> str:
    return f"{num_bytes / 1024:.3g} KiB"


def _context(num_tokens: int) -> str:
    return f"{num_tokens // 2**20}M" if num_tokens >= 2**20 else f"{num_tokens // 1024}k"


def cache_table(models: list[SequenceCache]) -> str:
    """The models side by side, a row per figure (aligned text)."""
    rows = [
        ("per token of context", [_kib(m.bytes_per_token) for m in models]),
        ("window, at most", [_size(m.window_bytes) for m in models]),
        ("state, whatever the length", [_size(m.state_bytes) for m in models]),
    ]
    for i, n in enumerate(CONTEXTS):
        rows.append((f"{_context(n)} tokens", [_size(m.at_context[i]) for m in models]))
        rows.append((f"  per token at {_context(n)}", [_kib(m.at_context[i] / n) for m in models]))
    rows.append(("saved state (prefix caching), each", [_size(m.state_bytes) for m in models]))
    header = ("cache per sequence", [m.name for m in models])
    width = max(len(label) for label, _ in (header, *rows))
    columns = [max(len(row[1][i]) for row in (header, *rows)) for i in range(len(models))]
    lines = [
        "  ".join([label.ljust(width), *(cell.rjust(w) for cell, w in zip(cells, columns))])
        for label, cells in (header, *rows)
    ]
    note = (
        f"one rank, bf16 KV and conv state, float32 recurrent state, blocks of {BLOCK_SIZE}; the engine sets "
        "max_num_seqs states and --saved-states saved ones (default max_num_seqs) aside before the blocks; "
        "a saved state copies a sequence's states (DeepSeek-V4: its open compression windows)"
    )
    return "\n".join([*lines, note])
