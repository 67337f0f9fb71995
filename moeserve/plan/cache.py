"""`moeserve plan --cache-per-sequence`: what one sequence's cache costs, model beside model, from
the layers' cache specs (`CacheSpecs`, the numbers the engine budgets with), not from a formula of
the planner's own: a hybrid's fixed state beside its attention layers' paged KV shows where it
pays (long contexts) and where it does not (short ones), and what each saved state prefix
caching holds costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.config import ModelConfig
from moeserve.models.decoder import cache_specs

CONTEXTS = (1024, 32 * 1024, 128 * 1024)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class SequenceCache:
    """One model's cache bytes on one rank (TP 1), bf16 KV and conv state, float32 recurrent state."""

    name: str
    bytes_per_token: int
    """Paged bytes per token of context, every attention layer together."""
    state_bytes: int
    """A sequence's states, whatever its length (0 without state layers); a saved state of prefix
    caching costs as much."""
    at_context: tuple[int, ...]
    """Bytes of a sequence of each of `CONTEXTS` tokens: its whole blocks and its states."""


def sequence_cache(config: ModelConfig, name: str) -> SequenceCache:
    specs = cache_specs(config, torch.bfloat16)
    return SequenceCache(
        name,
        specs.bytes_per_block(BLOCK_SIZE) // BLOCK_SIZE,
        specs.state_bytes_per_sequence,
        tuple(specs.bytes_per_sequence(n, BLOCK_SIZE) for n in CONTEXTS),
    )


def _mib(num_bytes: int) -> str:
    if not num_bytes:
        return "-"
    mib = num_bytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 100 or mib == int(mib) else f"{mib:.1f} MiB"


def cache_table(models: list[SequenceCache]) -> str:
    """The models side by side, a row per figure (aligned text)."""
    rows = [
        ("per token of context", [f"{m.bytes_per_token / 1024:g} KiB" for m in models]),
        ("state, whatever the length", [_mib(m.state_bytes) for m in models]),
        *((f"{n // 1024}k tokens", [_mib(m.at_context[i]) for m in models]) for i, n in enumerate(CONTEXTS)),
        ("saved state (prefix caching), each", [_mib(m.state_bytes) for m in models]),
    ]
    header = ("cache per sequence", [m.name for m in models])
    width = max(len(label) for label, _ in (header, *rows))
    columns = [max(len(row[1][i]) for row in (header, *rows)) for i in range(len(models))]
    lines = [
        "  ".join([label.ljust(width), *(cell.rjust(w) for cell, w in zip(cells, columns))])
        for label, cells in (header, *rows)
    ]
    note = (
        f"one rank, bf16 KV and conv state, float32 recurrent state, blocks of {BLOCK_SIZE}; the engine sets "
        "max_num_seqs states and --saved-states saved ones (default max_num_seqs) aside before the blocks"
    )
    return "\n".join([*lines, note])
