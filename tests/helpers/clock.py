"""Clocks for code that takes a `clock` callable, so tests choose what time it is."""

from __future__ import annotations


class TickingClock:
    """Advances one second per reading, so every timestamp is distinct and predictable."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class ManualClock:
    """Reads the same time until the test advances it (`clock.now = ...`)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
