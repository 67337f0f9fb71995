"""What a step's state layers (Gated DeltaNet) need beside attention's plan: each sequence's
state slot, its token count, and whether it resumes from the slot's state or starts afresh.

A layer's state lives in `LinearState` (one row per slot, `CacheSpecs`' `StateSpec`); the runner
binds it to the step (`StateStep`) in place of a paged layer's cache tensor, so the model's
forward signature is the same for every architecture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateBatch:
    """B sequences, in the step's packing order.

    slots:      per sequence, the state slot it reads and writes.
    query_lens: per sequence, its tokens in this step (they add up to T).
    resumes:    per sequence, True when it continues from its slot's state (a later prompt
                chunk, a decode), False when it starts at position 0 from zeros.
    drafts:     per sequence, the draft tokens it verifies this step (the last of its tokens):
                the state after each of its tokens is kept (`LinearState.draft_conv` and
                `draft_recurrent`), for the next step to step back to the last one accepted.
    restores:   per sequence, -1, or the index of the kept state to continue from: the
                previous step verified drafts and accepted this many (fewer than it fed).
    """

    slots: tuple[int, ...]
    query_lens: tuple[int, ...]
    resumes: tuple[bool, ...]
    drafts: tuple[int, ...] = ()
    restores: tuple[int, ...] = ()


@dataclass(frozen=True)
class LinearState:
    """One Gated DeltaNet layer's states: conv `[N, C, K - 1]` (model dtype), recurrent
    `[N, Hv, Dk, Dv]` (float32), N slots; with speculative decoding also the states after each of
    a verify step's 1 + k tokens, `[N, 1 + k, ...]` each (None without); with prefix caching the
    saved states a prefix-cache hit starts from, `[S, ...]` each (None without)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    draft_conv: torch.Tensor | None = None
    draft_recurrent: torch.Tensor | None = None
    saved_conv: torch.Tensor | None = None
    saved_recurrent: torch.Tensor | None = None

    def restore(self, slots: Sequence[int], restores: Sequence[int]) -> None:
        """Each sequence whose restore index is not -1 continues from the state after its last
        accepted draft (kept by the previous step's verify, whichever backend ran it)."""
        picked = [(slot, index) for slot, index in zip(slots, restores) if index >= 0]
        if not picked:
            return
        dst, index = (torch.tensor(column, dtype=torch.int64, device=self.conv.device) for column in zip(*picked))
        self.conv[dst] = self.draft_conv[dst, index]
        self.recurrent[dst] = self.draft_recurrent[dst, index]

    def load_saved(self, slots: Sequence[int], saved: Sequence[int]) -> None:
        """Sequence slots `slots` start from the saved states `saved` (a prefix-cache hit)."""
        dst, src = (torch.tensor(i, dtype=torch.int64, device=self.conv.device) for i in (slots, saved))
        self.conv[dst] = self.saved_conv[src]
        self.recurrent[dst] = self.saved_recurrent[src]

    def save(self, slots: Sequence[int], saved: Sequence[int]) -> None:
        """Copy the states of sequence slots `slots` into saved-state slots `saved`."""
        src, dst = (torch.tensor(i, dtype=torch.int64, device=self.conv.device) for i in (slots, saved))
        self.saved_conv[dst] = self.conv[src]
        self.saved_recurrent[dst] = self.recurrent[src]


@dataclass(frozen=True)
class StateStep:
    """A layer's states bound to this step's sequences."""

    state: LinearState
    batch: StateBatch
