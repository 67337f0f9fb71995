"""The highest request rate that still meets the SLOs: bracket by doubling, then bisect.

A probe is one bounded run at a rate; it passes when the fraction of its requests meeting every
objective is at least the target. From the start rate the search doubles while probes pass (or
halves while they fail) until one rate passes and the next one up fails, then bisects that
bracket until it is narrower than `tolerance` relative to its low end. The answer is the highest
rate that passed; the knee lies between it and the lowest rate that failed. Attainment is noisy
near the knee, so the bracket is an estimate, as good as the probes are long.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SearchSettings:
    target: float
    """Attainment (all objectives) a rate must reach to pass, e.g. 0.99."""
    start_rate: float = 1.0
    tolerance: float = 0.05
    """Stop when (lowest failing - highest passing) / highest passing is at most this."""
    max_probes: int = 16


@dataclass(frozen=True)
class Probe:
    rate: float
    attainment: float
    passed: bool


@dataclass
class SearchResult:
    max_rate: float | None
    """The highest rate that passed; None if none did."""
    min_failing_rate: float | None
    """The lowest rate that failed; None if none did (the server never saturated)."""
    probes: list[Probe] = field(default_factory=list)

    @property
    def bracketed(self) -> bool:
        """Whether the knee was pinned between a passing and a failing rate."""
        return self.max_rate is not None and self.min_failing_rate is not None


async def find_max_rate(probe: Callable[[float], Awaitable[float]], settings: SearchSettings) -> SearchResult:
    """Search with `probe(rate) -> attainment`; at most `settings.max_probes` probes."""
    result = SearchResult(None, None)

    async def passes(rate: float) -> bool:
        attained = await probe(rate)
        passed = attained >= settings.target
        result.probes.append(Probe(rate, attained, passed))
        if passed:
            result.max_rate = rate if result.max_rate is None else max(result.max_rate, rate)
        else:
            result.min_failing_rate = rate if result.min_failing_rate is None else min(result.min_failing_rate, rate)
        return passed

    rate = settings.start_rate
    step = 2.0 if await passes(rate) else 0.5
    while not result.bracketed and len(result.probes) < settings.max_probes:
        rate *= step
        await passes(rate)
    while result.bracketed and len(result.probes) < settings.max_probes:
        low, high = result.max_rate, result.min_failing_rate
        if high < low or (high - low) / low <= settings.tolerance:
            break
        await passes((low + high) / 2)
    return result
