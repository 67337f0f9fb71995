"""A stat logger that adds up what the engine reports, for tests that read its counters."""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.engine.stats import IterationStats


@dataclass
class CountingStatLogger:
    """Sums of the per-step counters, as /metrics would show them."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0

    def record(self, stats: IterationStats) -> None:
        self.prefix_cache_queries += stats.prefix_cache_queries
        self.prefix_cache_hits += stats.prefix_cache_hits
        self.num_preemptions += stats.num_preemptions
