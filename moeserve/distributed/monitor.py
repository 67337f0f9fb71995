"""Node 0 watching its ranks: a lost rank is named within seconds (and the engine stops or heals).

Two signals, checked every `POLL_S`:
- node 0's own rank processes: an exit is seen at once (with the signal or code, and the last
  error line the rank left in the store);
- every rank's heartbeat counter in the store: one that stops moving for `heartbeat_timeout_s`
  is stalled or unreachable (a frozen process, a dead machine, a cut network). Until a rank has
  beaten once it is still starting, which `startup_timeout_s` bounds instead.

When one rank dies mid-step its peers fail a moment later in the collective they shared with
it, so one poll often sees several dead ranks. The report names the cause first: a rank killed
by a signal or failing on its own, before ranks whose error is a broken connection to a peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from moeserve.config import ParallelConfig
from moeserve.distributed.launcher import exit_description
from moeserve.distributed.processes import ChildProcess
from moeserve.distributed.rendezvous import heartbeat_key, read_error

logger = logging.getLogger(__name__)

POLL_S = 0.25
SETTLE_S = 0.3  # after a first loss, how long to let the knock-on failures show before reporting
_PEER_FAILURE_MARKS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _caused_by_peer(error: str | None) -> bool:
    return error is not None and any(mark in error for mark in _PEER_FAILURE_MARKS)


@dataclass(frozen=True)
class Loss:
    """Why the engine lost ranks, and which (launch ranks): the exited ones, or the silent one."""

    reason: str
    ranks: tuple[int, ...]


class RankMonitor:
    """Calls `on_lost(loss)` once, from its own thread, when any rank is lost.

    members: the launch ranks to watch (default: all); a monitor started after a heal watches
    the survivors only. `local_procs`: node 0's processes among them.
    """

    def __init__(
        self,
        store: dist.Store,
        parallel: ParallelConfig,
        local_procs: dict[int, ChildProcess],
        on_lost: Callable[[Loss], None],
        members: Sequence[int] | None = None,
    ) -> None:
        self._store, self._parallel, self._procs, self._on_lost = store, parallel, local_procs, on_lost
        self._members = tuple(range(parallel.ep)) if members is None else tuple(members)
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._last_beat: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._thread = threading.Thread(target=self._run, name="moeserve-rank-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self._check() is None:
                continue
            # Let the knock-on failures show, so the cause is named first; survivors that heal
            # never die of a lost peer, so under heal there are none to wait for.
            if self._parallel.on_rank_failure != "heal":
                time.sleep(SETTLE_S)
            loss = self._check()
            if loss is not None and not self._stop.is_set():
                self._stop.set()
                self._on_lost(loss)
                return

    def _check(self) -> Loss | None:
        exits = self._exits()
        if exits:
            return exits
        return self._silence()

    def _exits(self) -> Loss | None:
        """Node 0's ranks that exited, the likely cause first; None if all run."""
        dead = []
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                error = read_error(self._store, rank)
                secondary = code > 0 and _caused_by_peer(error)
                dead.append(
                    (
                        secondary,
                        rank,
                        f"rank {rank} (node 0, pid {proc.pid}) {exit_description(code)}"
                        + (f": {error}" if error else ""),
                    )
                )
        if not dead:
            return None
        dead.sort()
        first = dead[0][2]
        others = [str(rank) for _, rank, _ in dead[1:]]
        reason = first + (f" (then rank(s) {', '.join(others)} failed too)" if others else "")
        return Loss(reason, tuple(sorted(rank for _, rank, _ in dead)))

    def _silence(self) -> Loss | None:
        now = time.monotonic()
        for rank in self._members:
            try:
                beats = self._store.add(heartbeat_key(rank), 0)
            except Exception as exc:  # noqa: BLE001 - the store lives in this process; this is not expected
                return Loss(f"node 0's store failed: {exc}", ())
            counter, moved = self._last_beat.get(rank, (0, self._started))
            if beats != counter:
                self._last_beat[rank] = (beats, now)
                continue
            node = rank // self._parallel.ranks_per_node
            if beats == 0 and now - moved > self._parallel.startup_timeout_s:
                return Loss(
                    f"rank {rank} (node {node}) did not join within {self._parallel.startup_timeout_s:.0f} s", (rank,)
                )
            if beats > 0 and now - moved > self._parallel.heartbeat_timeout_s:
                error = read_error(self._store, rank)
                reason = f"rank {rank} (node {node}) sent no heartbeat for {now - moved:.1f} s: stalled or unreachable"
                return Loss(reason + (f" ({error})" if error else ""), (rank,))
        return None
