"""Node 0 and the other nodes' launch processes keeping track of each other.

Node 0 learns of a lost node from its ranks' heartbeats (`monitor.py`). The other direction needs
a signal of its own: a node cut off from node 0 has ranks blocked in a store call or a collective
that a dead peer never answers (TCP gives up after many minutes), so nothing there ever ends. So
node 0 publishes a beat twice a second on a socket of its own (`Beacon`), and each other node's
launch process listens (`NodeZeroWatch`): silence for `--heartbeat-timeout` means node 0 is gone
or unreachable, and the node stops its ranks and exits non-zero. A node 0 that stops says so
(`NodeZeroLeaving`), cleanly or not, and the others follow with exit 0 or 1.

A socket of its own, not the control channel: that one is the engine thread's (ZeroMQ sockets
are not thread-safe) and carries every step's plans, which a launch process has no use for.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time

import zmq

from moeserve.config import ParallelConfig
from moeserve.distributed.messages import NodeZeroBeat, NodeZeroLeaving
from moeserve.distributed.rendezvous import BEACON_KEY, connect_store, get

logger = logging.getLogger(__name__)

BEAT_S = 0.5
_POLL_MS = 250


class Beacon:
    """Node 0's pulse, bound on `bind_host` at a port the OS picks; `address` is what the other
    nodes subscribe to."""

    def __init__(self, bind_host: str, advertise_host: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 16)  # a cut link drops beats rather than queue them
        self._socket.setsockopt(zmq.LINGER, 1000)  # the leaving message still goes out at close
        port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertise_host}:{port}"
        self._serving = False
        self._leaving: NodeZeroLeaving | None = None
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeserve-beacon", daemon=True)
        self._thread.start()

    def serving(self) -> None:
        self._serving = True

    def leave(self, clean: bool, reason: str) -> None:
        """Tell the other nodes node 0 stops, then close (idempotent)."""
        if self._leaving is None:
            self._leaving = NodeZeroLeaving(clean, reason)
            self._wake.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        seq = 0
        while not self._wake.wait(BEAT_S):
            seq += 1
            self._socket.send(pickle.dumps(NodeZeroBeat(seq, self._serving)))
        self._socket.send(pickle.dumps(self._leaving))
        self._socket.close()
        self._context.term()


class NodeZeroWatch:
    """A node's launch process listening to node 0's `Beacon`, from a daemon thread.

    `lost()` says why this node should stop, once: silence for `heartbeat_timeout_s` after a
    first beat (before one, node 0 may still be starting: `startup_timeout_s` bounds that).
    `leaving` is node 0's own word that it stops.
    """

    def __init__(self, parallel: ParallelConfig) -> None:
        self._parallel = parallel
        self._started = time.monotonic()
        self._last: tuple[float, NodeZeroBeat] | None = None
        self._failed: str | None = None
        self.leaving: NodeZeroLeaving | None = None
        self._closing = threading.Event()
        threading.Thread(target=self._run, name="moeserve-node0-watch", daemon=True).start()

    def close(self) -> None:
        self._closing.set()

    def lost(self) -> str | None:
        p = self._parallel
        node0 = f"node 0 ({p.master_addr}:{p.master_port})"
        if self._failed is not None:
            return f"{node0} could not be reached: {self._failed}"
        now = time.monotonic()
        if self._last is None:
            if now - self._started > p.startup_timeout_s:
                return f"heard nothing from {node0} within --startup-timeout {p.startup_timeout_s:g} s"
            return None
        heard_at, beat = self._last
        if now - heard_at <= p.heartbeat_timeout_s:
            return None
        state = "serving" if beat.serving else "waiting for the ranks to load"
        return (
            f"heard nothing from {node0} for {now - heard_at:.1f} s (--heartbeat-timeout {p.heartbeat_timeout_s:g} s); "
            f"last heard beat {beat.seq}, node 0 {state}: node 0 is gone or unreachable"
        )

    def _run(self) -> None:
        p = self._parallel
        try:
            address = get(connect_store(p.master_addr, p.master_port, timeout_s=p.startup_timeout_s), BEACON_KEY)
        except Exception as exc:  # noqa: BLE001 - any failure to reach node 0 ends this node the same way
            self._failed = f"{type(exc).__name__}: {exc}"
            return
        context = zmq.Context()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(address)
        logger.info("node %d: listening to node 0's beat at %s", p.node_rank, address)
        while not self._closing.is_set():
            if not socket.poll(_POLL_MS):
                continue
            message = pickle.loads(socket.recv())
            if isinstance(message, NodeZeroBeat):
                self._last = (time.monotonic(), message)
            elif isinstance(message, NodeZeroLeaving):
                self.leaving = message
        socket.close()
        context.term()
