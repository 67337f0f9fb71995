"""Pushes from a prefill instance whose KV cache lives in rank processes (`--ep > 1`).

The engine core knows which blocks hold a request's KV but not their memory: each data-parallel
group's cache is in its first rank's process, with that process's NIXL agent registered on it. So
such a rank serves writes on a side channel of its own, and the core hands each push to the rank
of the group that prefilled the request: the bytes go from the rank's cache straight into the
decode side's, never through the core, and the rank's steps go on meanwhile (the blocks it
writes out are pinned, nothing computes into them).

    POST /kv/push  {dest: registration, src_blocks, dst_blocks, write_by, states} -> {bytes}

`src_blocks` and `dst_blocks` are per block-table group (the core and its ranks are one build).

`write_by` is the decode side's deadline for the bytes (wall clock), passed on unchanged: the rank
honours the same instant the core was given, whatever the hop to it cost.
"""

from __future__ import annotations

import time
from typing import Protocol

from moeserve.kv_transfer.agent import KvAgent, KvRegistration
from moeserve.kv_transfer.layout import NO_STATE, BlocksByGroup, Slots
from moeserve.kv_transfer.side_channel import REPLY_GRACE_S, SideChannel, reply_bytes, request_push


class KvWriter(Protocol):
    """Whatever writes a group's blocks into a peer's cache: the agent itself when the cache is in
    the core's process (ep 1), a `RankWriter` when it is in a rank process."""

    def write(
        self, dest: KvRegistration, src: BlocksByGroup, dst: BlocksByGroup, write_by: float, states: Slots = NO_STATE
    ) -> int:
        """Copy blocks `src` (per group, and the saved state `states` names) into `dst` of
        `dest`'s cache by `write_by`; the bytes moved (`KvAgent.write`)."""


class RankWriter:
    """A rank process's writes, asked for over its side channel at `address` (host:port)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def write(
        self, dest: KvRegistration, src: BlocksByGroup, dst: BlocksByGroup, write_by: float, states: Slots = NO_STATE
    ) -> int:
        body = {
            "dest": dest.to_json(),
            "src_blocks": [list(ids) for ids in src],
            "dst_blocks": [list(ids) for ids in dst],
            "write_by": write_by,
            "states": list(states),
        }
        return reply_bytes(request_push(self.address, body, write_by - time.time() + REPLY_GRACE_S), self.address)


def serve_writes(agent: KvAgent, host: str) -> SideChannel:
    """The rank's side channel, on a free port of `host`: it writes blocks of `agent`'s cache."""

    def write(body: dict) -> dict:
        src = [[int(b) for b in ids] for ids in body["src_blocks"]]
        dst = [[int(b) for b in ids] for ids in body["dst_blocks"]]
        src_state, dst_state = (int(s) for s in body.get("states", (-1, -1)))
        dest = KvRegistration.from_json(body["dest"])
        return {"bytes": agent.write(dest, src, dst, float(body["write_by"]), (src_state, dst_state))}

    return SideChannel(host, 0, None, write)
