"""A NIXL agent over one KV cache: registers it, describes it to peers, writes blocks into theirs.

Each process holding a KV cache (the engine core at ep 1, each rank process otherwise) owns one
agent. Only the prefill side initiates transfers (WRITE into the decode side's blocks), so a
decode rank needs nothing but its registration: its agent's metadata and its cache's layout,
which travel to the prefill instance with each push.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.kv_transfer.layout import KvLayout, paired_runs

POLL_S = 0.0005  # how often a transfer in progress is looked at


class KvTransferError(RuntimeError):
    """A transfer that did not complete; `cause` names why, for the failure counters."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class KvRegistration:
    """What a peer needs to write into this cache: the agent's name and metadata, and the layout."""

    agent_name: str
    metadata: bytes
    layout: KvLayout

    def to_json(self) -> dict:
        return {
            "agent_name": self.agent_name,
            "metadata": base64.b64encode(self.metadata).decode(),
            "layout": self.layout.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> KvRegistration:
        return cls(data["agent_name"], base64.b64decode(data["metadata"]), KvLayout.from_json(data["layout"]))


class KvAgent:
    """One process's NIXL agent with its KV cache registered. Thread-safe: pushes come from the
    side channel's threads."""

    def __init__(self, caches: Sequence[torch.Tensor], label: str) -> None:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        self.name = f"moeserve-{label}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self.layout = KvLayout.of(caches)
        self._agent.register_memory(list(caches))
        self._peers: dict[str, str] = {}  # agent name -> the name NIXL knows it by, once added
        self._lock = threading.Lock()

    @property
    def registration(self) -> KvRegistration:
        return KvRegistration(self.name, self._agent.get_agent_metadata(), self.layout)

    def write(
        self, dest: KvRegistration, src_blocks: Sequence[int], dst_blocks: Sequence[int], timeout_s: float
    ) -> int:
        """Copy blocks `src_blocks` of this cache to `dst_blocks` of `dest`'s; the bytes moved.
        Raises KvTransferError when the layouts differ, NIXL fails, or `timeout_s` passes."""
        if dest.layout.shape_key != self.layout.shape_key:
            raise KvTransferError(
                f"KV layouts differ: (layers, planes, block bytes) {self.layout.shape_key} here, "
                f"{dest.layout.shape_key} on the decode side",
                "layout",
            )
        src_runs, dst_runs = paired_runs(src_blocks, dst_blocks)
        with self._lock:
            peer = self._peers.get(dest.agent_name)
            if peer is None:
                peer = self._agent.add_remote_agent(dest.metadata)
                peer = peer.decode() if isinstance(peer, bytes) else peer
                self._peers[dest.agent_name] = peer
            local = self._agent.get_xfer_descs(self.layout.regions(src_runs), self.layout.mem_type)
            remote = self._agent.get_xfer_descs(dest.layout.regions(dst_runs), dest.layout.mem_type)
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer)
            try:
                state = self._agent.transfer(handle)
                deadline = time.monotonic() + timeout_s
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise KvTransferError(
                            f"KV write to {dest.agent_name} did not finish in {timeout_s} s", "timeout"
                        )
                    time.sleep(POLL_S)
                    state = self._agent.check_xfer_state(handle)
                if state != "DONE":
                    raise KvTransferError(f"NIXL reported {state} writing to {dest.agent_name}", "transport")
            finally:
                self._agent.release_xfer_handle(handle)
        return len(src_blocks) * self.layout.block_bytes * self.layout.planes * len(self.layout.layer_bases)
