"""The router's /metrics: requests and failures per instance, and each request's time to first
token split two ways: as the router times it (the prefill round trip, then the decode side's first
token), and by phase as the instances time them (prefill queue, prefill, KV transfer, first decode
step; each instance's `kv_transfer_params` answer carries its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moeserve.kv_transfer.phases import PHASE_LABELS

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["instance", "role"]
        self.requests = Counter("moeserve_router:requests", "Requests sent to an instance.", labels, registry=r)
        self.failures = Counter(
            "moeserve_router:instance_failures", "Requests an instance failed (unreachable or 5xx).", labels, registry=r
        )
        self.in_flight = Gauge("moeserve_router:in_flight", "Requests in flight at an instance.", labels, registry=r)
        self.healthy = Gauge(
            "moeserve_router:instance_healthy", "1 while an instance passes health checks.", labels, registry=r
        )
        self.ttft = Histogram(
            "moeserve_router:ttft_seconds", "Time to first token, as the router saw it.", buckets=BUCKETS, registry=r
        )
        self.prefill = Histogram(
            "moeserve_router:ttft_prefill_seconds",
            "Part of TTFT: the prefill instance's round trip (its queue and the prefill).",
            buckets=BUCKETS,
            registry=r,
        )
        self.decode_first = Histogram(
            "moeserve_router:ttft_decode_seconds",
            "Part of TTFT: from asking the decode instance to its first token (KV transfer, first decode step).",
            buckets=BUCKETS,
            registry=r,
        )

        self.phase = Histogram(
            "moeserve_router:ttft_phase_seconds",
            "Part of TTFT, as the instances timed it: prefill_queue and prefill on the prefill instance, transfer "
            "(from the decode instance's arrival to its first schedule, the KV load in it) and first_decode_step.",
            ["phase"],
            buckets=BUCKETS,
            registry=r,
        )
        for phase in PHASE_LABELS.values():  # every phase shows, empty until a request reports it
            self.phase.labels(phase)

    def observe_phases(self, timings: object) -> None:
        """Record an instance's `kv_transfer_params` answer; what is not a known phase is skipped
        (an older instance, a malformed answer: the request itself goes on)."""
        if not isinstance(timings, dict):
            return
        for key, phase in PHASE_LABELS.items():
            seconds = timings.get(key)
            if isinstance(seconds, (int, float)) and seconds >= 0:
                self.phase.labels(phase).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
