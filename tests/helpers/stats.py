"""A stat logger that adds up what the engine reports, for tests that read its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.engine.stats import IterationStats
from moeserve.spec_decode.stats import SpecDecodeStats


@dataclass
class CountingStatLogger:
    """Sums of the per-step counters, as /metrics would show them."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)

    def record(self, stats: IterationStats) -> None:
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
        if stats.spec_decode is not None:
            self.spec_decode.merge(stats.spec_decode)
