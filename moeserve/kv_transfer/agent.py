"""A NIXL agent over one KV cache: registers it, describes it to peers, writes blocks into theirs.

Each process holding a KV cache (the engine core at ep 1, each rank process otherwise) owns one
agent. Only the prefill side initiates transfers (WRITE into the decode side's blocks), so a
decode rank needs nothing but its registration: its agent's metadata and its cache's layout,
which travel to the prefill instance with each push.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from moeserve.kv_transfer.layout import (
    NO_STATE,
    BlocksByGroup,
    Cache,
    KvLayout,
    Slots,
    layouts_of,
    paired_runs,
    registered_tensors,
)

POLL_S = 0.0005  # how often a transfer in progress is looked at

logger = logging.getLogger(__name__)


class KvTransferError(RuntimeError):
    """A transfer that did not complete; `cause` names why, for the failure counters."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class KvRegistration:
    """What a peer needs to write into this cache: the agent's name and metadata, and the layout
    of each kind of paged tensor (`layouts_of`)."""

    agent_name: str
    metadata: bytes
    layouts: tuple[KvLayout, ...]

    def to_json(self) -> dict:
        return {
            "agent_name": self.agent_name,
            "metadata": base64.b64encode(self.metadata).decode(),
            "layouts": [layout.to_json() for layout in self.layouts],
        }

    @classmethod
    def from_json(cls, data: dict) -> KvRegistration:
        layouts = tuple(KvLayout.from_json(layout) for layout in data["layouts"])
        return cls(data["agent_name"], base64.b64decode(data["metadata"]), layouts)


class KvAgent:
    """One process's NIXL agent with its KV cache registered. Thread-safe, and transfers to
    different peers (or to the same one) run concurrently: pushes come from the side channel's
    threads, and one slow decode peer must not hold up the others."""

    def __init__(self, caches: Sequence[Cache], label: str) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = f"moeserve-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # Strict sync: NIXL serialises calls into the agent itself, so threads may share it.
        config = nixl_agent_config(backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._agent = nixl_agent(self.name, config)
        self.layouts = layouts_of(caches)
        self._agent.register_memory(registered_tensors(caches))
        self._peers: dict[str, str] = {}  # agent name -> the name NIXL knows it by, once added
        self._peers_lock = threading.Lock()

    @property
    def registration(self) -> KvRegistration:
        return KvRegistration(self.name, self._agent.get_agent_metadata(), self.layouts)

    def write(
        self, dest: KvRegistration, src: BlocksByGroup, dst: BlocksByGroup, write_by: float, states: Slots = NO_STATE
    ) -> int:
        """Copy blocks `src` of this cache to `dst` of `dest`'s (per block-table group), and with
        `states` (source slot, destination slot) >= 0 that saved state of every layer keeping one;
        the bytes moved. `write_by` (wall clock, `time.time()`) is when the decode side stops
        counting on the bytes: a transfer not done by then is cancelled, and this returns only
        once NIXL says nothing moves any more. Raises KvTransferError when the layouts differ,
        NIXL fails, or the deadline passes."""
        here, there = [x.shape_key for x in self.layouts], [x.shape_key for x in dest.layouts]
        if here != there:
            raise KvTransferError(
                f"KV layouts differ: (layers, planes, block bytes, state slot bytes, group) per kind {here} here, "
                f"{there} on the decode side",
                "layout",
            )
        deadline = time.monotonic() + (write_by - time.time())
        if deadline <= time.monotonic():
            raise KvTransferError(f"KV write to {dest.agent_name} came after its deadline", "timeout")
        runs = [paired_runs(s, d) for s, d in zip(src, dst, strict=True)]
        src_state, dst_state = states
        local = self._agent.get_xfer_descs(
            [r for x in self.layouts for r in x.regions(runs[x.group][0], src_state)], self.layouts[0].mem_type
        )
        remote = self._agent.get_xfer_descs(
            [r for x in dest.layouts for r in x.regions(runs[x.group][1], dst_state)], dest.layouts[0].mem_type
        )
        handle = self._agent.initialize_xfer("WRITE", local, remote, self._peer(dest))
        state = self._agent.transfer(handle)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(POLL_S)
            state = self._agent.check_xfer_state(handle)
        if state == "PROC":
            self._cancel(handle, dest.agent_name)
            raise KvTransferError(f"KV write to {dest.agent_name} did not finish by its deadline; cancelled", "timeout")
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise KvTransferError(f"NIXL reported {state} writing to {dest.agent_name}", "transport")
        return sum(layout.num_bytes(len(src[layout.group]), src_state >= 0) for layout in self.layouts)

    def _peer(self, dest: KvRegistration) -> str:
        """The name NIXL knows `dest`'s agent by, added on first use."""
        with self._peers_lock:
            peer = self._peers.get(dest.agent_name)
            if peer is None:
                peer = self._agent.add_remote_agent(dest.metadata)
                peer = peer.decode() if isinstance(peer, bytes) else peer
                self._peers[dest.agent_name] = peer
            return peer

    def _cancel(self, handle: object, peer: str) -> None:
        """Stop a transfer in progress. Releasing its handle cancels it; where NIXL cannot cancel,
        wait for it to end before releasing, so that the caller never reports a transfer over
        while bytes may still land (the decode side keeps the blocks until it hears back)."""
        try:
            self._agent.release_xfer_handle(handle)
            return
        except Exception:  # noqa: BLE001 - NIXL raises its own error types for "cannot cancel now"
            logger.warning("KV write to %s could not be cancelled; waiting for it to end", peer)
        while self._agent.check_xfer_state(handle) == "PROC":
            time.sleep(POLL_S)
        self._agent.release_xfer_handle(handle)
