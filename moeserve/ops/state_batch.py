"""What a step's state layers (Gated DeltaNet) need beside attention's plan: each sequence's
state slot, its token count, and whether it resumes from the slot's state or starts afresh.

A layer's state lives in `LinearState` (one row per slot, `CacheSpecs`' `StateSpec`); the runner
binds it to the step (`StateStep`) in place of a paged layer's cache tensor, so the model's
forward signature is the same for every architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateBatch:
    """B sequences, in the step's packing order.

    slots:      per sequence, the state slot it reads and writes.
    query_lens: per sequence, its tokens in this step (they add up to T).
    resumes:    per sequence, True when it continues from its slot's state (a later prompt
                chunk, a decode), False when it starts at position 0 from zeros.
    """

    slots: tuple[int, ...]
    query_lens: tuple[int, ...]
    resumes: tuple[bool, ...]


@dataclass(frozen=True)
class LinearState:
    """One Gated DeltaNet layer's states: conv `[N, C, K - 1]` (model dtype), recurrent
    `[N, Hv, Dk, Dv]` (float32), N slots."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass(frozen=True)
class StateStep:
    """A layer's states bound to this step's sequences."""

    state: LinearState
    batch: StateBatch
