"""The KV transfer metrics of one instance, in the engine core's process where transfers happen;
the server appends them to its /metrics (read over the side channel at each scrape)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FAILURE_CAUSES = ("refused", "unreachable", "timeout", "transport", "layout", "malformed", "internal")


class KvTransferStats:
    """Counted on both roles: a prefill instance counts the pushes it made, a decode instance the
    loads it asked for (bytes and seconds as the decode side waited for them)."""

    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["role"]
        self.bytes = Counter("moeserve:kv_transfer_bytes", "KV bytes moved between instances.", labels, registry=r)
        self.seconds = Histogram(
            "moeserve:kv_transfer_seconds",
            "Time of one request's KV transfer (decode: from asking to having it).",
            labels,
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("moeserve:kv_transfers_in_flight", "KV transfers under way.", labels, registry=r)
        self.failures = Counter(
            "moeserve:kv_transfer_failures", "KV transfers that failed, by cause.", ["role", "cause"], registry=r
        )
        self.held_blocks = Gauge(
            "moeserve:kv_transfer_held_blocks",
            "KV blocks held for a transfer: a prefill's blocks awaiting their push, a decode's awaiting their load.",
            labels,
            registry=r,
        )
        self.role = role
        for cause in FAILURE_CAUSES:  # every cause shows, at 0 until it happens
            self.failures.labels(role, cause)

    def transferred(self, num_bytes: int, seconds: float) -> None:
        self.bytes.labels(self.role).inc(num_bytes)
        self.seconds.labels(self.role).observe(seconds)

    def failed(self, cause: str) -> None:
        self.failures.labels(self.role, cause if cause in FAILURE_CAUSES else "transport").inc()

    def set_in_flight(self, count: int) -> None:
        self.in_flight.labels(self.role).set(count)

    def set_held_blocks(self, count: int) -> None:
        self.held_blocks.labels(self.role).set(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
