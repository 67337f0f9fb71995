"""What each engine step did, in numbers: token counts, latencies, queue and KV occupancy.

The engine measures on its own clock, at the moment a step's tokens exist, so TTFT and TBT do
not include how long the HTTP layer took to ship them; the SLO counters judge the engine, and a
load generator (`moeserve bench serve`) measures what clients see. Stat loggers (Prometheus, the
periodic log line) receive an `IterationStats` after every step and after every abort, on the
engine's thread, and must be quick and thread-safe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.executor.healing import HealReport, RejoinReport
from moeserve.scheduler.block_groups import GroupBlocks
from moeserve.slo import DEFAULT_CLASS
from moeserve.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestMetrics:
    """One finished request's life, as the engine saw it (seconds, monotonic clock)."""

    finish_reason: str
    """"stop", "length" or "abort": the first sample's reason (the request's, when n is 1)."""
    num_prompt_tokens: int
    num_generation_tokens: int
    """Tokens generated over all samples."""
    queue_time_s: float | None
    """Arrival to first scheduled; None if it never ran (aborted while queued)."""
    ttft_s: float | None
    """Arrival to the first token of any sample; None if none was generated."""
    e2e_s: float
    """Arrival to finish."""
    max_tbt_s: float | None
    """The longest gap between consecutive tokens of one sample; None with fewer than two tokens."""
    ttft_met: bool
    """A first token came within the TTFT target."""
    tbt_met: bool
    """Every gap between consecutive tokens was within the TBT target (true with no gaps)."""
    slo_class: str = DEFAULT_CLASS
    """The SLO class its targets belong to (`moeserve.slo`), the label of its verdicts."""
    best_effort_ttft_s: float | None = None
    """Admitted as best effort, with this predicted TTFT over its target; None: admitted on a
    prediction of meeting it, or with no prediction made."""


@dataclass
class IterationStats:
    """One step (or one abort between steps): counters to add and gauges to set."""

    step_duration_s: float | None = None
    """Wall time of the model step; None for stats sent outside a step (an abort)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of requests whose prefill completed in this step."""
    num_generation_tokens: int = 0
    """Tokens sampled in this step."""
    num_preemptions: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    """The TTFT of each request that got its first token in this step."""
    tbts_s: list[float] = field(default_factory=list)
    """Every gap between a sample's previous token and its token from this step."""
    finished: list[RequestMetrics] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    saved_states_held: int = 0
    saved_states_total: int = 0
    group_blocks: tuple[GroupBlocks, ...] = ()
    """Each block-table group's (name, blocks held, pool); `kv_blocks_*` are their sums."""
    ttft_promised: int = 0
    """Requests admitted on a prediction of meeting their TTFT target, since the engine started
    (a running total, as the core keeps it: the metrics count its increase)."""
    ttft_promises_kept: int = 0
    """Of those, the ones that did."""
    routed_tokens: RoutedTokens | None = None
    """Expert load since the previous stats that carried one (about once a second, and at
    every rebalance: no report spans two expert maps)."""
    rebalances: list[RebalanceReport] = field(default_factory=list)
    """Live expert rebalances that ended with this step."""
    heals: list[HealReport] = field(default_factory=list)
    """Lost ranks healed in this step (`--on-rank-failure heal`)."""
    rejoins: list[RejoinReport] = field(default_factory=list)
    """Restarted ranks taken back into the group before this step."""
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted in this step, each admission counted (vLLM's count)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens whose KV the prefix cache held, so they were not computed."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's drafts in this step; None when no sequence drafted."""


class StatLogger(Protocol):
    """Receives every step's stats on the engine thread; must not block."""

    def record(self, stats: IterationStats) -> None: ...


class LoggingStatLogger:
    """An INFO line every `interval_s` while there is work: throughput, queue and KV usage.

    Operators watching a terminal see that the server is busy and how busy, without /metrics.
    """

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._since = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def record(self, stats: IterationStats) -> None:
        self._prompt_tokens += stats.num_prompt_tokens
        self._generation_tokens += stats.num_generation_tokens
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return
        if self._prompt_tokens or self._generation_tokens or stats.num_running or stats.num_waiting:
            usage = 100.0 * stats.kv_blocks_used / max(stats.kv_blocks_total, 1)
            logger.info(
                "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, waiting %d, KV "
                "cache %.1f%% used",
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                stats.num_running,
                stats.num_waiting,
                usage,
            )
        self._since, self._prompt_tokens, self._generation_tokens = now, 0, 0
