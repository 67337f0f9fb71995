"""What a heal is, for the engine above the executor: the error that asks for one, and its report.

With `--on-rank-failure heal` a lost rank does not stop the multi-process executor: the step in
flight raises `RanksLostError`, the engine core asks the executor to heal (`Executor.heal`: fence
the lost ranks, regroup the survivors, recover their experts) and requeues the requests
(`DataParallelScheduler.heal`), and the report goes out with the next step to /metrics.
Plain data, no torch: it crosses the wire between the core and the API process.
"""

from __future__ import annotations

from dataclasses import dataclass


class RanksLostError(RuntimeError):
    """Ranks are gone and the executor can heal: the step in flight is abandoned.

    lost: the lost ranks as launched; detected_at: when the monitor named them (monotonic)."""

    def __init__(self, reason: str, lost: tuple[int, ...], detected_at: float) -> None:
        super().__init__(reason)
        self.reason, self.lost, self.detected_at = reason, lost, detected_at


@dataclass(frozen=True)
class HealReport:
    """One heal, stage by stage (seconds; monotonic clock of node 0).

    detected_at: when the monitor named the loss; abort_s: from then until the step in flight was
    abandoned (the core stopped waiting for it); fence_s: killing and reaping the lost ranks, then
    the slowest survivor leaving the broken group and forming the new one; experts_s: the slowest
    survivor's expert recovery; requeue_s: moving and requeueing the requests; total_s: from
    detection to serving again.
    """

    lost_ranks: tuple[int, ...]
    reason: str
    ranks_left: int
    generation: int
    lost_groups: tuple[int, ...]
    """The data-parallel groups that went with them, as numbered before the heal."""
    detected_at: float
    abort_s: float
    fence_s: float
    experts_s: float
    peer_slots: int
    checkpoint_slots: int
    recovered_bytes: int
    requeue_s: float = 0.0
    moved_requests: int = 0
    total_s: float = 0.0

    def describe(self) -> str:
        return (
            f"healed: lost rank(s) {', '.join(map(str, self.lost_ranks))} ({self.reason}); serving on "
            f"{self.ranks_left} ranks after {self.total_s:.2f} s (abort {self.abort_s:.2f} s, fence "
            f"{self.fence_s:.2f} s, experts {self.experts_s:.2f} s: {self.peer_slots} slots from surviving "
            f"replicas, {self.checkpoint_slots} from the checkpoint, {self.recovered_bytes / 2**20:.2f} MiB; "
            f"requeue {self.requeue_s:.3f} s, {self.moved_requests} requests moved to other groups)"
        )


@dataclass(frozen=True)
class RejoinReport:
    """Restarted ranks taken back into the group (seconds; monotonic clock of node 0).

    restarted_at: when node 0 restarted the first of them; load_s: from then until the last one
    reported its share of the model loaded; wait_s: from then until the engine's next step took
    them in; pause_s: the steps' pause for it: their subscription checked, the group re-formed
    (regroup_s, the slowest rank) and the expert slots refilled (experts_s, the slowest rank);
    total_s: from the restart to serving with them.
    """

    ranks: tuple[int, ...]
    """Launch ranks of the returned ranks, appended in this order to the group."""
    ranks_now: int
    generation: int
    restarted_at: float
    load_s: float
    wait_s: float
    regroup_s: float
    experts_s: float
    peer_slots: int
    checkpoint_slots: int
    moved_bytes: int
    pause_s: float
    total_s: float

    def describe(self) -> str:
        return (
            f"rejoined: rank(s) {', '.join(map(str, self.ranks))} back, serving on {self.ranks_now} ranks "
            f"(process group generation {self.generation}) {self.total_s:.2f} s after the restart (load "
            f"{self.load_s:.2f} s, wait for a step {self.wait_s:.2f} s, pause {self.pause_s:.3f} s: regroup "
            f"{self.regroup_s:.3f} s, experts {self.experts_s:.3f} s, {self.peer_slots} slots from other ranks, "
            f"{self.checkpoint_slots} from the checkpoint, {self.moved_bytes / 2**20:.2f} MiB)"
        )
