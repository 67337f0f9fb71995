"""Node 0's TCP store: where ranks find the control channel, their spec and each other.

Node 0 hosts the store at `master_addr:master_port`; every rank connects to it, reads the
`WorkerSpec` and the control channel's addresses, beats its heartbeat counter, leaves its error
there before dying, and the ranks build their torch.distributed group on a prefix of it.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from moeserve.distributed.processes import started_by

logger = logging.getLogger(__name__)

SPEC_KEY = "moeserve/spec"
CONTROL_KEY = "moeserve/control"
RANKS_PREFIX = "moeserve/ranks"  # the ranks' own process group
GENERATION_KEY = "moeserve/generation"  # of that group: 0 at launch, one more with each regroup
BEACON_KEY = "moeserve/beacon"  # node 0's pulse to the other nodes (`node_watch`)


def heartbeat_key(rank: int) -> str:
    return f"moeserve/heartbeat/{rank}"


def error_key(rank: int) -> str:
    return f"moeserve/error/{rank}"


def host_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Node 0's store, listening on every interface (`port` 0: a free one, see `.port`)."""
    return dist.TCPStore(
        "0.0.0.0", port, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def connect_store(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def put(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, pickle.dumps(value))


def get(store: dist.Store, key: str) -> Any:
    """Waits for `key` up to the store's timeout."""
    return pickle.loads(store.get(key))


def read_error(store: dist.Store, rank: int) -> str | None:
    """What a rank left before dying, if it got that far."""
    key = error_key(rank)
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store itself may be going away
        return None


class Heartbeat:
    """A rank's pulse: a daemon thread adds 1 to its counter every `interval_s`.

    It also watches what the rank lives for: if the store stops answering (node 0 is gone) or,
    for a rank node 0 started itself, its parent process died, the rank exits at once rather
    than waiting for a collective to time out. The parent is watched from a thread of its own:
    on a cut network a store call blocks for as long as TCP keeps trying (many minutes), and
    a rank whose node process is gone must not outlive it meanwhile.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        parent_pid: int | None,
        on_orphaned: Callable[[str], None],
        interval_s: float = 0.5,
    ) -> None:
        self._store, self._rank, self._parent_pid = store, rank, parent_pid
        self._on_orphaned, self._interval_s = on_orphaned, interval_s
        threading.Thread(target=self._beat, name="moeserve-heartbeat", daemon=True).start()
        if parent_pid is not None:
            threading.Thread(target=self._watch_parent, name="moeserve-parent-watch", daemon=True).start()

    def _beat(self) -> None:
        key = heartbeat_key(self._rank)
        while True:
            try:
                self._store.add(key, 1)
            except Exception as exc:  # noqa: BLE001 - whatever broke, node 0 is unreachable
                self._on_orphaned(f"node 0's store stopped answering ({exc})")
                return
            time.sleep(self._interval_s)

    def _watch_parent(self) -> None:
        while started_by(self._parent_pid):
            time.sleep(self._interval_s)
        self._on_orphaned("the process that started this rank is gone")
