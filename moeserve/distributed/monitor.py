"""Node 0 watching its ranks: a lost rank stops the engine within seconds, and is named.

Two signals, checked every `POLL_S`:
- node 0's own rank processes: an exit is seen at once (with the signal or code, and the last
  error line the rank left in the store);
- every rank's heartbeat counter in the store: one that stops moving for `heartbeat_timeout_s`
  is stalled or unreachable (a frozen process, a dead machine, a cut network). Until a rank has
  beaten once it is still starting, which `startup_timeout_s` bounds instead.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from moeserve.config import ParallelConfig
from moeserve.distributed.launcher import exit_description
from moeserve.distributed.rendezvous import heartbeat_key, read_error

logger = logging.getLogger(__name__)

POLL_S = 0.25


class RankMonitor:
    """Calls `on_lost(reason)` once, from its own thread, when any rank is lost."""

    def __init__(
        self,
        store: dist.Store,
        parallel: ParallelConfig,
        local_procs: dict[int, subprocess.Popen],
        on_lost: Callable[[str], None],
    ) -> None:
        self._store, self._parallel, self._procs, self._on_lost = store, parallel, local_procs, on_lost
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._last_beat: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        self._thread = threading.Thread(target=self._run, name="moeserve-rank-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            reason = self._check()
            if reason is not None and not self._stop.is_set():
                self._stop.set()
                self._on_lost(reason)
                return

    def _check(self) -> str | None:
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                error = read_error(self._store, rank)
                return f"rank {rank} (node 0, pid {proc.pid}) {exit_description(code)}" + (f": {error}" if error else "")
        now = time.monotonic()
        for rank in range(self._parallel.ep):
            try:
                beats = self._store.add(heartbeat_key(rank), 0)
            except Exception as exc:  # noqa: BLE001 - the store lives in this process; this is not expected
                return f"node 0's store failed: {exc}"
            counter, moved = self._last_beat.get(rank, (0, self._started))
            if beats != counter:
                self._last_beat[rank] = (beats, now)
                continue
            node = rank // self._parallel.ranks_per_node
            if beats == 0 and now - moved > self._parallel.startup_timeout_s:
                return f"rank {rank} (node {node}) did not join within {self._parallel.startup_timeout_s:.0f} s"
            if beats > 0 and now - moved > self._parallel.heartbeat_timeout_s:
                error = read_error(self._store, rank)
                return (f"rank {rank} (node {node}) sent no heartbeat for {now - moved:.1f} s: stalled or unreachable"
                        + (f" ({error})" if error else ""))
        return None
