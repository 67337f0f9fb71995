"""Prometheus metrics for /metrics: latency histograms, queue and KV gauges, SLO attainment.

Names follow vLLM's (`vllm:` becomes `moeserve:`) so existing dashboards port with a rename.
Each server owns its own `CollectorRegistry`: several servers in one process (tests) must not
share counters, and the global registry's process metrics say nothing about the engine.

SLO attainment is three counters over finished requests, aborted ones included (a client that
gave up waiting is a miss, not an absence): `moeserve:slo_requests_total`, and of those
`moeserve:slo_ttft_met_requests_total` and `moeserve:slo_tbt_met_requests_total`. Attainment is
the ratio, e.g. `rate(moeserve:slo_ttft_met_requests_total[5m]) / rate(moeserve:slo_requests_total[5m])`.
Goodput, requests per second that met both targets, is `rate(moeserve:slo_met_requests_total[5m])`:
the two per-target counts cannot give it, since one request may meet one target and miss the other.
Each request is judged by its own targets (`slo` in the body); the same three counts by SLO class
are `moeserve:slo_class_*_total{class}`, beside `moeserve:slo_rejections_total{class}` (requests
SLO admission refused). The unlabelled totals keep the names and series dashboards already read.
Whether admission keeps its word: `moeserve:slo_admission_promised_requests_total` (requests it
admitted on a prediction of meeting their TTFT target) and of those
`moeserve:slo_admission_promises_kept_total` (first token within the target); the ratio is the
share of promises kept, which should stay near 1.
The targets are histogram bucket edges too, so the histograms answer the same question per token.

Prefix caching, in tokens as vLLM counts them: `moeserve:prefix_cache_queries_total` (tokens of
every sequence admitted, readmissions after preemption included) and of those
`moeserve:prefix_cache_hits_total` (found cached, not computed); their ratio is the hit rate.

KV blocks: `moeserve:kv_cache_blocks_used` and `_total` count every block-table group together;
`moeserve:kv_cache_group_blocks_used{group}` and `_total{group}` each group (`group`:
`cache_spec.BlockGroup.name`, `full` for a model with one table per request, DeepSeek-V4's
`window`, `compressed_4` and `compressed_128`). A window group's use stays near the running
sequences' windows whatever their length; a compressed group's grows a block per
`block_size x ratio` tokens, so it is the one that fills.

Speculative decoding (`--speculative-config`), as vLLM counts it: `moeserve:spec_decode_num_drafts_total`
(sequence-steps that fed drafts), `moeserve:spec_decode_num_draft_tokens_total`,
`moeserve:spec_decode_num_accepted_tokens_total` and, by draft position,
`moeserve:spec_decode_num_accepted_tokens_per_pos_total{position}`. Acceptance rate: accepted / draft
tokens; mean accepted length (tokens a drafting sequence gains per step): 1 + accepted / drafts.

Expert parallelism: `moeserve:expert_routed_tokens_total` (rows routed to experts, all MoE
layers together), `moeserve:ep_rank_routed_tokens_total{rank}` (rows each rank's experts
received) and `moeserve:expert_load_imbalance{over}` (max / mean of the ranks' loads in a MoE
layer, `over` the layers' "mean" or the "worst" layer; 1.0 is perfect balance). A model has
hundreds of experts and dozens of layers, and each label value is a series Prometheus keeps, so
these are aggregated by default; `--per-expert-metrics` labels the first by `expert` and the
last by `layer` instead (one series per expert, one per MoE layer). Per expert and layer would
be layers x experts series (15k for DeepSeek-V3), too many for any setup. The ranks report their loads about
once a second and at every live rebalance (so no report spans two placements); the gauge takes
a new value once the reports since its last one hold `IMBALANCE_MIN_ROWS` rows in the layer,
since a few steps' split of a few hundred rows over the ranks is mostly noise, and a rebalance
drops the rows not yet used, so its next value is measured under the new placement only.
What the all-to-all moves (`dispatch.wire`): `moeserve:ep_dispatch_bytes_total{rank}` and
`moeserve:ep_combine_bytes_total{rank}` (payload bytes sent to other ranks), the same split by
`link` in `moeserve:ep_dispatch_link_bytes_total{rank,link}` and
`moeserve:ep_combine_link_bytes_total{rank,link}` (`intra_domain`: inside the rank's NVLink
domain; `inter_domain`: through the NIC, between nodes) and `moeserve:ep_local_rows_total{rank}`
(rows that stayed on their rank).

Expert load balancing (`--enable-eplb`): `moeserve:eplb_rebalances_total`,
`moeserve:eplb_moved_experts_total` (expert slots whose weights changed rank) and
`moeserve:eplb_moved_bytes_total` (weight bytes sent between ranks), and the last rebalance's
`moeserve:eplb_last_rebalance_seconds` (gathering loads, planning and moving weights: the pause
between two steps) and `moeserve:eplb_last_rebalance_imbalance{when,over}`: max / mean rank load
`when` "before" or "after" it, `over` the MoE layers' "mean" or the "worst" layer, as the
balancer computed it on its window's loads (before the first rebalance the time reads 0 and the
imbalance series are absent).

The Responses API's store: `moeserve:responses_store_bytes`, what the stored responses and their
conversations take (as JSON), within `--responses-store-bytes`.

Structured outputs: `moeserve:structured_outputs_compile_timeouts_total`, grammar compiles ended
at `--structured-outputs-compile-timeout`. A timeout refuses its request only (it depends on the
load of the moment, so it is not cached as invalid specs are): a rising count means the compile
workers are short of CPU or the limit is tight for the specs clients send.

Healing (`--on-rank-failure heal`): `moeserve:rank_failures_total` (ranks lost and healed over),
`moeserve:heals_total` and `moeserve:last_heal_seconds` (from naming the lost rank to serving
again); `moeserve:rank_rejoins_total` (restarted ranks taken back into the group) and
`moeserve:last_rejoin_seconds` (the steps' pause for the last one: regroup and expert slots).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 - re-exported for the app
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from moeserve.config import SLOConfig
from moeserve.dispatch.expert_load import RoutedTokens, load_imbalance
from moeserve.dispatch.wire import LINKS
from moeserve.engine.stats import IterationStats
from moeserve.eplb.rebalancer import RebalanceReport
from moeserve.spec_decode.stats import SpecDecodeStats

disable_created_metrics()
"""No `*_created` series: one more series per counter and histogram child, holding a start time
Prometheus does not use (it detects counter resets itself), which only doubles what a scrape stores."""

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
_TBT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
    5.0,
)


IMBALANCE_MIN_ROWS = 2048
"""Rows of one MoE layer behind each value of the imbalance gauge. Measured on a skewed router
over 4 ranks, balanced to 1.05 over its whole run: windows of ~770 rows read up to 1.11 (1.18 on
a server), of ~1500 rows up to 1.08."""


def _with_edge(buckets: tuple[float, ...], edge: float) -> tuple[float, ...]:
    """`buckets` plus the SLO target, so `le="<target>"` counts exactly the observations that met it."""
    return tuple(sorted(set(buckets) | {edge}))


class BatchHistogram:
    """A Prometheus histogram fed a whole step's observations at once.

    Every step brings one time-between-tokens per stream; `prometheus_client`'s `observe` walks
    the bucket list and takes a lock per value (about 2-5 us each, 64 per step). Here a step's
    values are binned with a binary search under one lock. Exposed like `Histogram` (`_bucket`,
    `_count`, `_sum`), by a collector on the server's registry.
    """

    def __init__(
        self, name: str, doc: str, buckets: tuple[float, ...], model_name: str, registry: CollectorRegistry
    ) -> None:
        self.name, self.doc, self._model_name = name, doc, model_name
        self._bounds = [*sorted(buckets), math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        if not values:
            return
        bounds, counts = self._bounds, self._counts
        with self._lock:
            for value in values:
                counts[bisect_left(bounds, value)] += 1  # the first bucket with value <= le
            self._sum += sum(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self._model_name], buckets, total)
        yield family


class ServerMetrics:
    """Every metric the server exports; `record` is a `StatLogger` the engine calls each step."""

    def __init__(
        self,
        model_name: str,
        slo: SLOConfig,
        imbalance_min_rows: int = IMBALANCE_MIN_ROWS,
        per_expert: bool = False,
    ) -> None:
        self.registry = CollectorRegistry()
        self.slo = slo
        self.imbalance_min_rows = imbalance_min_rows
        self.per_expert = per_expert
        self._layer_imbalance: dict[int, float] = {}  # MoE layer -> its gauge value, for the aggregate
        self._unsampled: dict[int, list[int]] = {}  # MoE layer -> rows per rank not yet in the gauge
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        self.ttft = BatchHistogram(
            "moeserve:time_to_first_token_seconds",
            "Arrival to first generated token, per request.",
            _with_edge(_TTFT_BUCKETS, slo.ttft_s),
            model_name,
            r,
        )
        self.tbt = BatchHistogram(
            "moeserve:time_between_tokens_seconds",
            "Every gap between consecutive tokens of a request's sample.",
            _with_edge(_TBT_BUCKETS, slo.tbt_s),
            model_name,
            r,
        )
        self.e2e = histogram(
            "moeserve:e2e_request_latency_seconds", "Arrival to finish, per finished request.", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "moeserve:request_queue_time_seconds",
            "Arrival to first scheduled step, per request that ran.",
            _REQUEST_BUCKETS,
        )
        self.step_time = histogram(
            "moeserve:engine_step_duration_seconds",
            "Wall time of one engine step (model forward and sampling).",
            _STEP_BUCKETS,
        )

        self.running = gauge("moeserve:num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge(
            "moeserve:num_requests_waiting", "Sequences queued for admission (preempted ones included)."
        )
        self.kv_used = gauge("moeserve:kv_cache_blocks_used", "Paged KV blocks held by sequences.")
        self.kv_total = gauge("moeserve:kv_cache_blocks_total", "Paged KV blocks in the cache.")
        group = [*labels, "group"]  # a block-table group: full; DeepSeek-V4's window, compressed_4, compressed_128
        self._group_used = Gauge(
            "moeserve:kv_cache_group_blocks_used",
            "Paged KV blocks held by sequences, by block-table group.",
            group,
            registry=r,
        )
        self._group_total = Gauge(
            "moeserve:kv_cache_group_blocks_total",
            "Paged KV blocks in each block-table group's pool.",
            group,
            registry=r,
        )
        self.state_slots_used = gauge(
            "moeserve:state_slots_used", "State slots held by running sequences (models with state layers)."
        )
        self.state_slots_total = gauge("moeserve:state_slots_total", "State slots in the cache.")
        self.saved_states_held = gauge(
            "moeserve:saved_states_held", "Saved states prefix caching holds for hits (models with state layers)."
        )
        self.saved_states_total = gauge("moeserve:saved_states_total", "Saved-state slots in the cache.")

        self.prompt_tokens = counter(
            "moeserve:prompt_tokens", "Prompt tokens prefilled (counted once, when the first token comes)."
        )
        self.generation_tokens = counter("moeserve:generation_tokens", "Tokens generated.")
        self.preemptions = counter("moeserve:num_preemptions", "Sequences preempted (KV dropped, to be recomputed).")
        self.prefix_cache_queries = counter(
            "moeserve:prefix_cache_queries", "Tokens of sequences admitted, looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "moeserve:prefix_cache_hits", "Tokens of sequences admitted that the prefix cache held (not computed)."
        )
        self.spec_drafts = counter(
            "moeserve:spec_decode_num_drafts", "Sequence-steps that fed draft tokens (speculative decoding)."
        )
        self.spec_draft_tokens = counter("moeserve:spec_decode_num_draft_tokens", "Draft tokens fed for verification.")
        self.spec_accepted_tokens = counter(
            "moeserve:spec_decode_num_accepted_tokens", "Draft tokens the target model kept."
        )
        self._spec_accepted_per_pos = Counter(
            "moeserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept, by position after the sequence's last token (0: the first draft).",
            [*labels, "position"],
            registry=r,
        )
        self._finished = Counter(
            "moeserve:request_success", "Finished requests, by finish reason.", [*labels, "finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort"):
            self._finished.labels(model_name, reason)  # export zeros, so rates exist before the first one
        self.slo_total = counter(
            "moeserve:slo_requests", "Finished requests judged against the SLO (aborted ones included)."
        )
        self.slo_ttft_met = counter(
            "moeserve:slo_ttft_met_requests", "Finished requests whose first token came within the TTFT target."
        )
        self.slo_tbt_met = counter(
            "moeserve:slo_tbt_met_requests", "Finished requests all of whose token gaps were within the TBT target."
        )
        self.slo_met = counter(
            "moeserve:slo_met_requests",
            "Finished requests that met both targets (first token and every gap): its rate is the goodput.",
        )

        def by_class(name: str, doc: str) -> Counter:
            """A counter labelled by SLO class: a bounded set (`SLOCatalog.labels`), all exported from 0."""
            family = Counter(name, doc, [*labels, "class"], registry=r)
            for label in slo.catalog.labels:
                family.labels(model_name, label)
            return family

        self.slo_class_total = by_class(
            "moeserve:slo_class_requests", "The requests of moeserve:slo_requests, by the SLO class judging them."
        )
        self.slo_class_ttft_met = by_class(
            "moeserve:slo_class_ttft_met_requests", "The requests of moeserve:slo_ttft_met_requests, by SLO class."
        )
        self.slo_class_tbt_met = by_class(
            "moeserve:slo_class_tbt_met_requests", "The requests of moeserve:slo_tbt_met_requests, by SLO class."
        )
        self.slo_rejections = by_class(
            "moeserve:slo_rejections",
            "Requests refused at once (HTTP 429) because their TTFT target was predicted to be missed, by class.",
        )
        self.ttft_promised = counter(
            "moeserve:slo_admission_promised_requests",
            "Requests SLO admission admitted on a prediction of meeting their TTFT target.",
        )
        self.ttft_promises_kept = counter(
            "moeserve:slo_admission_promises_kept",
            "Of moeserve:slo_admission_promised_requests, those whose first token came within the target.",
        )
        self._promises_seen = (0, 0)  # the core's running totals, as last counted
        targets = Gauge(
            "moeserve:slo_target_seconds", "The SLO targets requests are judged against.", [*labels, "kind"], registry=r
        )
        targets.labels(model_name, "ttft").set(slo.ttft_s)
        targets.labels(model_name, "tbt").set(slo.tbt_s)
        self._expert_rows = Counter(
            "moeserve:expert_routed_tokens",
            "Token rows routed to experts (to each expert with --per-expert-metrics), all MoE layers together.",
            [*labels, "expert"] if per_expert else labels,
            registry=r,
        )
        self._rank_rows = Counter(
            "moeserve:ep_rank_routed_tokens",
            "Token rows the experts of each expert-parallel rank received.",
            [*labels, "rank"],
            registry=r,
        )
        self._imbalance = Gauge(
            "moeserve:expert_load_imbalance",
            f"Max over mean of the ranks' routed rows in a MoE layer, over {imbalance_min_rows} or more recent "
            "rows (none from before the last rebalance): the layers' mean and worst, or each layer with "
            "--per-expert-metrics.",
            [*labels, "layer"] if per_expert else [*labels, "over"],
            registry=r,
        )
        self._wire = {
            name: Counter(name, doc, [*labels, "rank"], registry=r)
            for name, doc in (
                ("moeserve:ep_dispatch_bytes", "Bytes each EP rank's MoE dispatch sent to other ranks (payload)."),
                ("moeserve:ep_combine_bytes", "Bytes each EP rank's MoE combine sent back to other ranks (payload)."),
                ("moeserve:ep_local_rows", "Rows each EP rank dispatched to its own expert slots (no link crossed)."),
            )
        }
        self._link_wire = {
            name: Counter(name, doc, [*labels, "rank", "link"], registry=r)
            for name, doc in (
                (
                    "moeserve:ep_dispatch_link_bytes",
                    "EP dispatch bytes sent to other ranks, inside or between NVLink domains.",
                ),
                (
                    "moeserve:ep_combine_link_bytes",
                    "EP combine bytes sent back to other ranks, inside or between NVLink domains.",
                ),
            )
        }
        self.rebalances = counter("moeserve:eplb_rebalances", "Live expert rebalances done.")
        self.moved_experts = counter(
            "moeserve:eplb_moved_experts", "Expert slots whose weights live rebalances moved to another rank."
        )
        self.moved_bytes = counter(
            "moeserve:eplb_moved_bytes", "Expert weight bytes live rebalances sent between ranks."
        )
        self.rebalance_time = gauge(
            "moeserve:eplb_last_rebalance_seconds",
            "Pause of the last live rebalance: gathering loads, planning and moving expert weights.",
        )
        self._rebalance_imbalance = Gauge(
            "moeserve:eplb_last_rebalance_imbalance",
            "Max over mean rank load on the last rebalance's window, before or after it, layer mean or worst layer.",
            [*labels, "when", "over"],
            registry=r,
        )
        self.rank_failures = counter(
            "moeserve:rank_failures", "Expert-parallel ranks lost (killed, failing or silent) that the engine healed."
        )
        self.heals = counter("moeserve:heals", "Heals after lost ranks (--on-rank-failure heal).")
        self.heal_time = gauge(
            "moeserve:last_heal_seconds",
            "The last heal, from naming the lost rank to serving again: abort, fence, expert recovery, requeue.",
        )
        self.rejoins = counter("moeserve:rank_rejoins", "Restarted ranks taken back into the group.")
        self.rejoin_time = gauge(
            "moeserve:last_rejoin_seconds",
            "The steps' pause for the last rejoin: the returned rank subscribed, regrouped, expert slots refilled.",
        )
        self.responses_store_bytes = gauge(
            "moeserve:responses_store_bytes",
            "Bytes (as JSON) of the stored /v1/responses responses and their conversations (--responses-store-bytes).",
        )
        self.compile_timeouts = counter(
            "moeserve:structured_outputs_compile_timeouts",
            "Structured-output grammar compiles ended at --structured-outputs-compile-timeout (not cached).",
        )
        self._http = Counter(
            "moeserve:http_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=r,
        )
        self._model_name = model_name

    def _record_promises(self, promised: int, kept: int) -> None:
        """Count the increase of the core's running totals. Frames sent with no scheduler carry
        zeros, so only a total above the highest seen is new."""
        seen_promised, seen_kept = self._promises_seen
        self.ttft_promised.inc(max(0, promised - seen_promised))
        self.ttft_promises_kept.inc(max(0, kept - seen_kept))
        self._promises_seen = (max(promised, seen_promised), max(kept, seen_kept))

    def record_slo_rejection(self, slo_class: str) -> None:
        """Count a request refused by SLO admission; runs on the event loop."""
        self.slo_rejections.labels(self._model_name, slo_class).inc()

    def _record_spec_decode(self, spec: SpecDecodeStats) -> None:
        self.spec_drafts.inc(spec.num_drafts)
        self.spec_draft_tokens.inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self._spec_accepted_per_pos.labels(self._model_name, str(position)).inc(count)

    def record(self, stats: IterationStats) -> None:
        """Fold one engine step (or abort) into the metrics; runs on the engine thread."""
        if stats.step_duration_s is not None:
            self.step_time.observe(stats.step_duration_s)
        self.ttft.observe_many(stats.ttfts_s)
        self.tbt.observe_many(stats.tbts_s)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.spec_decode is not None:
            self._record_spec_decode(stats.spec_decode)
        for request in stats.finished:
            self._finished.labels(self._model_name, request.finish_reason).inc()
            self.e2e.observe(request.e2e_s)
            if request.queue_time_s is not None:
                self.queue_time.observe(request.queue_time_s)
            self.slo_total.inc()
            self.slo_ttft_met.inc(request.ttft_met)
            self.slo_tbt_met.inc(request.tbt_met)
            self.slo_met.inc(request.ttft_met and request.tbt_met)
            label = self._model_name, request.slo_class
            self.slo_class_total.labels(*label).inc()
            self.slo_class_ttft_met.labels(*label).inc(request.ttft_met)
            self.slo_class_tbt_met.labels(*label).inc(request.tbt_met)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        for group, used, total in stats.group_blocks:
            self._group_used.labels(self._model_name, group).set(used)
            self._group_total.labels(self._model_name, group).set(total)
        self.state_slots_used.set(stats.state_slots_used)
        self.state_slots_total.set(stats.state_slots_total)
        self.saved_states_held.set(stats.saved_states_held)
        self.saved_states_total.set(stats.saved_states_total)
        self._record_promises(stats.ttft_promised, stats.ttft_promises_kept)
        if stats.routed_tokens is not None:
            self._record_routing(stats.routed_tokens)
        for rebalance in stats.rebalances:
            self._record_rebalance(rebalance)
        if stats.rebalances:
            self._unsampled.clear()  # counted under the placement just replaced
        for heal in stats.heals:
            self.rank_failures.inc(len(heal.lost_ranks))
            self.heals.inc()
            self.heal_time.set(heal.total_s)
        for rejoin in stats.rejoins:
            self.rejoins.inc(len(rejoin.ranks))
            self.rejoin_time.set(rejoin.pause_s)
        if stats.heals or stats.rejoins:
            self._unsampled.clear()  # counted over the ranks before the regroup

    def _record_rebalance(self, report: RebalanceReport) -> None:
        self.rebalances.inc()
        self.moved_experts.inc(report.experts_moved)
        self.moved_bytes.inc(report.bytes_moved)
        self.rebalance_time.set(report.balance_s + report.transfer_s)
        for when, (mean, worst) in (("before", report.imbalance_before), ("after", report.imbalance_after)):
            self._rebalance_imbalance.labels(self._model_name, when, "mean").set(mean)
            self._rebalance_imbalance.labels(self._model_name, when, "worst").set(worst)

    def _record_routing(self, routed: RoutedTokens) -> None:
        name = self._model_name
        if self.per_expert:
            for expert, rows in enumerate(map(sum, zip(*routed.counts))):
                self._expert_rows.labels(name, str(expert)).inc(rows)
        else:
            self._expert_rows.labels(name).inc(sum(map(sum, routed.counts)))
        for i, layer in enumerate(routed.layers):
            load = routed.per_rank(i)
            for rank, rows in enumerate(load):
                self._rank_rows.labels(name, str(rank)).inc(rows)
            unsampled = self._unsampled.pop(layer, None)
            unsampled = load if unsampled is None else [a + b for a, b in zip(unsampled, load)]
            imbalance = load_imbalance(unsampled)
            if imbalance is not None and sum(unsampled) >= self.imbalance_min_rows:
                self._set_imbalance(layer, imbalance)
            else:
                self._unsampled[layer] = unsampled
        wire = routed.wire
        for rank in range(len(wire.rows) if wire is not None else 0):
            self._wire["moeserve:ep_dispatch_bytes"].labels(name, str(rank)).inc(wire.dispatch_bytes(rank))
            self._wire["moeserve:ep_combine_bytes"].labels(name, str(rank)).inc(wire.combine_bytes(rank))
            self._wire["moeserve:ep_local_rows"].labels(name, str(rank)).inc(wire.local(rank))
            for link in LINKS:
                dispatched, combined = wire.dispatch_bytes(rank, link), wire.combine_bytes(rank, link)
                self._link_wire["moeserve:ep_dispatch_link_bytes"].labels(name, str(rank), link).inc(dispatched)
                self._link_wire["moeserve:ep_combine_link_bytes"].labels(name, str(rank), link).inc(combined)

    def _set_imbalance(self, layer: int, imbalance: float) -> None:
        """Each layer keeps its last value; by default the gauge shows their mean and worst."""
        if self.per_expert:
            self._imbalance.labels(self._model_name, str(layer)).set(imbalance)
            return
        self._layer_imbalance[layer] = imbalance
        values = self._layer_imbalance.values()
        self._imbalance.labels(self._model_name, "mean").set(sum(values) / len(values))
        self._imbalance.labels(self._model_name, "worst").set(max(values))

    def count_http(self, route: str, status: int) -> None:
        self._http.labels(route, str(status)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
