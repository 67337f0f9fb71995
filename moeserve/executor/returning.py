"""Node 0 restarting its lost ranks (`--on-rank-failure heal`, `--rank-restarts N`).

On one node the server started every rank process itself, so it is the one to start a lost one
again, as a supervisor (Kubernetes, Slurm) would restart a failed container or task: after a
heal, each lost rank is started afresh with its launch flags. It loads its share of the model
while the others serve, reports, and the executor takes it back into the group at the engine's
next step (`MultiprocessExecutor.rejoin`). A restart that dies or does not load within the
start-up timeout is tried again while restarts are left (`rank_restarts` per launch rank over
the server's life, so a rank that can never load does not restart forever); without any left the
engine serves on without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from moeserve.distributed.launcher import exit_description
from moeserve.distributed.messages import LoadReport
from moeserve.distributed.processes import ChildProcess
from moeserve.distributed.rendezvous import error_key, read_error

logger = logging.getLogger(__name__)


@dataclass
class Restart:
    """One restarted rank process on its way back; `loaded_at` set once it reported loaded."""

    member: int
    proc: ChildProcess
    started_at: float
    loaded_at: float | None = None


class ReturningRanks:
    """start(member) -> the new process (node 0 keeps it with its other rank processes)."""

    def __init__(
        self, limit: int, startup_timeout_s: float, store: dist.Store, start: Callable[[int], ChildProcess]
    ) -> None:
        self._limit, self._timeout_s, self._store, self._start = limit, startup_timeout_s, store, start
        self._used: dict[int, int] = {}  # launch rank -> restarts so far
        self.pending: dict[int, Restart] = {}

    def restart(self, member: int) -> None:
        """Start `member` again, if it has restarts left."""
        used = self._used.get(member, 0)
        if used >= self._limit:
            logger.warning("rank %d stays out: %d restart(s) used (--rank-restarts %d)", member, used, self._limit)
            return
        self._used[member] = used + 1
        self._store.delete_key(error_key(member))  # the lost process's; the new one leaves its own
        proc = self._start(member)
        self.pending[member] = Restart(member, proc, time.monotonic())
        logger.info(
            "restarting rank %d (pid %d, restart %d of %d): it rejoins at the engine's next step once loaded",
            member,
            proc.pid,
            used + 1,
            self._limit,
        )

    def note(self, report: LoadReport) -> bool:
        """Take a restarted rank's load report; False if `report` is not from one."""
        restart = self.pending.get(report.rank)
        if restart is None or restart.loaded_at is not None:
            return False
        if report.error is not None:  # the process exits after saying so; `ready` restarts it
            logger.error("restarted rank %d could not load the model: %s", report.rank, report.error)
            return True
        restart.loaded_at = time.monotonic()
        logger.info(
            "restarted rank %d loaded in %.2f s; it rejoins at the next step",
            report.rank,
            restart.loaded_at - restart.started_at,
        )
        return True

    def ready(self) -> list[Restart]:
        """The restarted ranks loaded and waiting to rejoin; a restart that died or overran the
        start-up timeout is stopped, named and tried again while restarts are left."""
        now = time.monotonic()
        for member, restart in list(self.pending.items()):
            code = restart.proc.poll()
            if code is not None:
                error = read_error(self._store, member)
                self.retry(member, exit_description(code) + (f": {error}" if error else ""))
            elif restart.loaded_at is None and now - restart.started_at > self._timeout_s:
                self.retry(member, f"did not load within {self._timeout_s:.0f} s")
        return [r for r in self.pending.values() if r.loaded_at is not None]

    def retry(self, member: int, why: str) -> None:
        """Stop a restart that cannot come back (`why`), then start it again if restarts are left."""
        restart = self.pending.pop(member)
        if restart.proc.poll() is None:
            restart.proc.kill()
            restart.proc.wait()
        logger.error("restarted rank %d (pid %d) %s", member, restart.proc.pid, why)
        self.restart(member)

    def taken(self, members: tuple[int, ...]) -> None:
        """These rejoined the group: no longer on their way back."""
        for member in members:
            del self.pending[member]
