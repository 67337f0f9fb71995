"""How an instance takes part in prefill/decode disaggregation (`--role`, `--kv-transfer`).

A prefill instance computes prompts and holds each one's KV blocks until a decode instance has
pulled them; a decode instance receives those blocks into its own paged cache and generates.
`both` is the colocated server, the default, which moves no KV anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moeserve.options import option

ROLES = ("both", "prefill", "decode")
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KvTransferConfig:
    role: Literal["both", "prefill", "decode"] = option("both", name="role")
    """both: prefill and decode here (colocated); prefill: compute prompts and hand their KV to a
    decode instance; decode: generate from KV a prefill instance computed."""
    backend: Literal["none", "nixl"] = option("none", name="kv_transfer")
    """How KV blocks move between instances: nixl (UCX, CPU or GPU memory); none with role both."""
    host: str = option("127.0.0.1", name="kv_transfer_host")
    """Address this instance's KV side channel listens on and tells its peers (handshakes, pushes)."""
    port: int = option(0, name="kv_transfer_port")
    """Port of the KV side channel; 0: a free one, chosen at start-up."""
    timeout_s: float = option(30.0, name="kv_transfer_timeout")
    """Seconds: a decode instance gives up on a transfer after this, and a prefill instance frees the
    blocks it holds for a transfer nobody asked for within it."""
    load_failure_policy: Literal["recompute", "fail"] = option("recompute", name="kv_load_failure_policy")
    """When a transfer fails (the prefill instance died, timed out or refused): recompute the prompt on
    the decode instance, or fail the request."""
    debug_push_delay_s: float = option(0.0, name="debug_kv_push_delay_ms", scale=0.001, hidden=True)
    """Test-only: a prefill instance waits this long (ms) before each push, so a test can kill it
    mid-transfer."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"--kv-load-failure-policy must be one of {', '.join(FAILURE_POLICIES)}")
        if self.role != "both" and self.backend != "nixl":
            raise ValueError(f"--role {self.role} needs --kv-transfer nixl")
        if not self.timeout_s > 0:
            raise ValueError(f"--kv-transfer-timeout must be > 0, got {self.timeout_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--kv-transfer-port must be in [0, 65535], got {self.port}")

    @property
    def enabled(self) -> bool:
        return self.role != "both"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def disaggregation_problem(config: KvTransferConfig, tp: int, prefix_caching: bool) -> str | None:
    """Why this instance cannot take `config.role` with its parallelism, or None. A decode instance
    admits loaded blocks through its prefix cache; tensor parallelism would split each block over
    ranks, which transfers do not handle yet."""
    if not config.enabled:
        return None
    if tp != 1:
        return f"--role {config.role} supports --tp 1 only (KV blocks split over tensor-parallel ranks do not move yet)"
    if config.role == "decode" and not prefix_caching:
        return "--role decode needs prefix caching (loaded KV blocks are admitted as a cached prefix)"
    return None
