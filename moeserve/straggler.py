"""A test-only straggler: one rank that computes slower than the others (`--debug-slow-rank`).

A GPU running hot or sharing its host runs its share of every step slower, and in lockstep the
whole step waits for it. To show what token-aware data-parallel routing does about that on a
CPU, the engine core emulates one: each step, after the ranks answer, it waits as long as the
slow rank's group would have taken longer, in proportion to the tokens that group computed, and
tells the scheduler which group took that long (`EngineCore.step`).

Imports nothing heavy: the command's parser uses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SlowRank:
    """Rank `rank` takes `ms_per_token` milliseconds longer per token its group computes in a step."""

    rank: int
    ms_per_token: float

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--debug-slow-rank: the rank must be >= 0, got {self.rank}")
        if not (math.isfinite(self.ms_per_token) and self.ms_per_token > 0):
            raise ValueError(f"--debug-slow-rank: the delay must be a number of ms > 0, got {self.ms_per_token}")

    def delay_s(self, num_tokens: int) -> float:
        """How much longer the rank's group takes for a step in which it computes `num_tokens` tokens."""
        return self.ms_per_token * num_tokens / 1000.0


def parse_slow_rank(text: str) -> SlowRank:
    """`R:MS` (the --debug-slow-rank flag): rank R, MS ms more per token of its group's share."""
    rank, sep, ms = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return SlowRank(int(rank), float(ms))
    except ValueError as e:
        detail = f": {e}" if str(e) else ""
        raise ValueError(f"--debug-slow-rank takes RANK:MS_PER_TOKEN, e.g. 3:0.5, got {text!r}{detail}") from None
