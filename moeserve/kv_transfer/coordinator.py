"""The KV transfer's part in the engine core: what a prefill instance holds, what a decode
instance loads, and when their blocks go back to the free list. Everything that touches a block
manager or the scheduler runs on the core's thread; the side channel's threads and the load
threads only hand results over (under `_lock`), and wake the core.

Prefill role: a request carrying `kv_transfer` finishes after its prompt (the router asks for one
token) with its prompt's full blocks pinned (`Request.kv_hold_id`). They stay pinned until a
decode instance's push has written them out, or `timeout_s` passes without one.

Decode role: a request carrying `kv_transfer` with a `remote` is an ordinary request to the core
(grammar, SLO admission, aborts, metrics) that the scheduler admits to wait for its KV
(`Scheduler._start_kv_load`): blocks from the one allocation path, cached prefix first. The
core hands each such `KvLoad` here; a thread asks the prefill instance to push into those blocks,
and when it ends the scheduler is told (`finish_kv_load`): loaded, the request computes only its
last partial block; failed, it recomputes its prompt or fails (`load_failure_policy`).

A model with state layers (Gated DeltaNet) moves with the blocks the state saved at the prompt's
last full block: a hold pins its saved-state slot on the prefill side, a load writes it into a
slot reserved on the decode side (`KvLoad.state_slot`), committed as a saved state when the load
ended well and freed otherwise, once the push has answered (`SavedStates.end_load`).

A model with several block-table groups (DeepSeek-V4) moves what resumes a prompt at its mark,
the last position where a hit may resume before its last token: holds and loads keep block ids
per group (`GroupBlockIds`: every compressed group's blocks before the mark, the window's it
reads from there), the push names the decode side's per group (`dst_group_blocks`, `RELEASED`
where nothing is written), and the open windows' state saved at the mark moves as a saved state.

Deadlines: each load has one absolute deadline, fixed when it is asked for. The prefill side must
have written by `write_by` (a share of it, in wall-clock time, so both sides read the same
instant); it cancels a write still under way then and answers only once nothing moves any more.
The decode side gives up on the request at its deadline, but the destination blocks keep the
load's own pin until the prefill side has answered (or the connection broke, or the deadline
plus a grace passed, which the prefill side respects): a late write can never land in blocks
another request has been given since.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from moeserve.kv_transfer.agent import KvRegistration, KvTransferError
from moeserve.kv_transfer.config import KvTransferConfig
from moeserve.kv_transfer.rank_writer import KvWriter
from moeserve.kv_transfer.side_channel import REPLY_GRACE_S, SideChannel, reply_bytes, request_push
from moeserve.kv_transfer.stats import KvTransferStats
from moeserve.scheduler import DataParallelScheduler, KvLoad, Request
from moeserve.scheduler.block_groups import RELEASED, GroupBlockIds

logger = logging.getLogger(__name__)

PUSH_DEADLINE_SHARE = 0.8
"""A push must have written its blocks within this share of the decode side's wait: what is left
covers the reply's trip and a skew between the two hosts' clocks."""


BlockIds = list[int] | GroupBlockIds
"""A hold's or a load's blocks: a list, or per block-table group for a model with several."""


@dataclass
class _Hold:
    transfer_id: str
    group: int
    block_ids: BlockIds
    deadline: float
    state_slot: int = -1
    """The pinned saved-state slot of the prompt's state at its mark (state layers)."""


@dataclass
class _Load:
    request_id: str
    group: int
    block_ids: BlockIds
    """The blocks the push writes into, pinned by the load itself until the push has answered."""
    started: float
    deadline: float
    """When the request stops waiting (monotonic); the prefill side writes by a share of it."""
    state_slot: int = -1
    """The saved-state slot the push writes the prompt's state into, reserved until it answers."""
    done: bool = False
    error: KvTransferError | None = None
    num_bytes: int = 0
    given_up: bool = False
    """The request went on without it (recomputed or failed); only the pins wait for the push."""


class KvCoordinator:
    def __init__(
        self,
        config: KvTransferConfig,
        scheduler: DataParallelScheduler,
        registrations: list[KvRegistration],
        writers: list[KvWriter],
    ) -> None:
        if config.role == "prefill" and len(writers) != len(scheduler.groups):
            raise ValueError(f"--role prefill needs a KV writer per data-parallel group, got {len(writers)}")
        self.config = config
        self.scheduler = scheduler
        self.registrations = registrations
        self.writers = writers
        """Prefill: group g's blocks are written out by `writers[g]` (its process's agent, or its rank's)."""
        self.stats = KvTransferStats(config.role)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._holds: dict[str, _Hold] = {}  # prefill: by transfer id, awaiting a push
        self._pushed: list[_Hold] = []  # prefill: pushed or failed, to unpin
        self._loads: dict[str, _Load] = {}  # decode: by request id, until its push has answered
        self._in_flight = 0
        push = self._push if config.role == "prefill" else None
        self.side_channel = SideChannel(config.host, config.port, self.stats.exposition, push)

    def close(self) -> None:
        self.side_channel.close()

    @property
    def busy(self) -> bool:
        """Blocks are held or loading: the core must keep turning to release or admit them."""
        return bool(self._holds or self._pushed or self._loads)

    @property
    def loading(self) -> bool:
        """Some request waits for its KV: a step with nothing to run should wait for a load to end."""
        return any(not load.given_up for load in self._loads.values())

    def wait(self, timeout_s: float) -> None:
        """Sleep until a push or a load ends, or `timeout_s` (the core has nothing else to do)."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    # ---- decode: loads the scheduler asked for -------------------------------------------------

    def start_load(self, order: KvLoad, group: int, request: Request) -> None:
        """Ask `request`'s prefill instance to push its prompt's KV into `order.block_ids` of
        `group`'s cache, on a thread of its own (the core steps on meanwhile)."""
        params = request.sampling_params.kv_transfer
        assert params is not None and params.remote is not None, "only a request with a remote loads"
        now = time.monotonic()
        block_ids = order.group_block_ids or list(order.block_ids)
        load = _Load(order.request_id, group, block_ids, now, now + self.config.timeout_s, order.state_slot)
        self.scheduler.groups[group].block_manager.pin(load.block_ids)
        self._loads[order.request_id] = load
        self._count_in_flight(+1)
        body = {
            "transfer_id": params.transfer_id,
            "dest": self.registrations[group].to_json(),
            "dst_blocks": list(order.block_ids),
            "first_block": order.first_block,
            "dst_state": order.state_slot,
            "write_by": time.time() + self.config.timeout_s * PUSH_DEADLINE_SHARE,
        }
        if order.group_block_ids:
            body["dst_group_blocks"] = [list(ids) for ids in order.group_block_ids]
        thread = threading.Thread(target=self._run_load, args=(load, params.remote, body), name="kv-load", daemon=True)
        thread.start()

    def _run_load(self, load: _Load, remote: str, body: dict) -> None:
        """The push's round trip; whatever happens, the load ends and the core hears of it."""
        try:
            answer = request_push(remote, body, self.config.timeout_s + REPLY_GRACE_S)
            load.num_bytes = reply_bytes(answer, remote)
        except KvTransferError as exc:
            load.error = exc
        except Exception as exc:  # noqa: BLE001 - a dead load thread would leave its request waiting forever
            logger.exception("KV load of %s failed unexpectedly", load.request_id)
            load.error = KvTransferError(f"the load failed here: {exc!r}", "internal")
        finally:
            with self._lock:
                load.done = True
            self._count_in_flight(-1)
            self._wake.set()

    # ---- the core's turn ---------------------------------------------------------------------

    def collect_holds(self) -> None:
        """Take over the blocks finished prefill requests left pinned, until pushed or expired."""
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:
            for g, group in enumerate(self.scheduler.groups):
                for transfer_id, block_ids, state_slot in group.kv_holds:
                    self._holds[transfer_id] = _Hold(transfer_id, g, block_ids, deadline, state_slot)
                group.kv_holds.clear()
        self._report_held()

    def settle(self) -> list[str]:
        """Release what is done with, resume or fall back the requests whose load ended or ran
        out of time; the ids of requests that end failed (`load_failure_policy` fail)."""
        self.collect_holds()
        now = time.monotonic()
        with self._lock:
            expired = [h for h in self._holds.values() if h.deadline < now]
            for hold in expired:
                del self._holds[hold.transfer_id]
                logger.warning("no decode instance pulled transfer %s in time; its KV is freed", hold.transfer_id)
                self.stats.failed("timeout")
            released, self._pushed = self._pushed + expired, []
            ended = [load for load in self._loads.values() if load.done]
        for hold in released:
            block_manager = self.scheduler.groups[hold.group].block_manager
            block_manager.unpin(hold.block_ids)
            if hold.state_slot >= 0:
                block_manager.saved_states.unpin(hold.state_slot)
        failed = []
        for load in ended:
            del self._loads[load.request_id]
            block_manager = self.scheduler.groups[load.group].block_manager
            block_manager.unpin(load.block_ids)
            if load.state_slot >= 0:  # findable before the request's admission looks for it
                block_manager.saved_states.end_load(load.state_slot, loaded=load.error is None and not load.given_up)
            if not load.given_up and self._resume(load):
                failed.append(load.request_id)
        for load in self._loads.values():
            if not load.given_up and load.deadline < now:
                load.error = KvTransferError(f"no KV arrived within {self.config.timeout_s} s", "timeout")
                if self._resume(load):
                    failed.append(load.request_id)
                load.given_up = True  # its pins wait for the prefill side's answer
        self._report_held()
        return failed

    def _resume(self, load: _Load) -> bool:
        """Tell the scheduler how `load` went; True when its request ends failed here."""
        if load.error is None:
            self.stats.transferred(load.num_bytes, time.monotonic() - load.started)
            self.scheduler.finish_kv_load(load.request_id, loaded=True)
            return False
        self.stats.failed(load.error.cause)
        if self.config.load_failure_policy == "fail":
            logger.error("KV load of %s failed: %s", load.request_id, load.error)
            return self.scheduler.finish_request(load.request_id, "abort")
        logger.warning("KV load of %s failed (%s); recomputing it here", load.request_id, load.error)
        self.scheduler.finish_kv_load(load.request_id, loaded=False)
        return False

    # ---- prefill: a decode instance's push (side channel thread) -------------------------------

    def _push(self, body: dict) -> dict:
        if self.config.debug_push_delay_s > 0:
            time.sleep(self.config.debug_push_delay_s)
        transfer_id = body["transfer_id"]
        with self._lock:
            hold = self._holds.pop(transfer_id, None)
        if hold is None:
            self.stats.failed("refused")
            raise KvTransferError(
                f"no KV is held here for transfer {transfer_id!r} (never prefilled here, already pushed, "
                f"or freed after --kv-transfer-timeout)",
                "refused",
            )
        self._count_in_flight(+1)
        started = time.monotonic()
        try:
            src_blocks, dst_blocks = _pairs(hold, body)
            write_by = float(body["write_by"])
            dst_state = int(body.get("dst_state", -1))
            if dst_state >= 0 and hold.state_slot < 0:
                raise KvTransferError(
                    f"transfer {transfer_id!r}: the prompt's state at its mark was not saved here", "refused"
                )
            states = (hold.state_slot, dst_state) if dst_state >= 0 else (-1, -1)
            if not any(dst_blocks):
                return {"bytes": 0, "seconds": 0.0}
            if write_by <= time.time():
                raise KvTransferError(
                    f"transfer {transfer_id!r} came too late: the decode side has given up", "timeout"
                )
            num_bytes = self.writers[hold.group].write(
                KvRegistration.from_json(body["dest"]), src_blocks, dst_blocks, write_by, states
            )
        except KvTransferError as exc:
            self.stats.failed(exc.cause)
            raise
        except Exception:
            self.stats.failed("internal")
            raise
        finally:
            self._count_in_flight(-1)
            with self._lock:
                self._pushed.append(hold)
            self._wake.set()
        seconds = time.monotonic() - started
        self.stats.transferred(num_bytes, seconds)
        return {"bytes": num_bytes, "seconds": seconds}

    # ---- gauges ------------------------------------------------------------------------------

    def _count_in_flight(self, delta: int) -> None:
        with self._lock:
            self._in_flight += delta
            self.stats.set_in_flight(self._in_flight)

    def _report_held(self) -> None:
        with self._lock:  # a push takes holds from another thread
            held = sum(_count(h.block_ids) for h in self._holds.values())
        held += sum(_count(load.block_ids) for load in self._loads.values())
        self.stats.set_held_blocks(held)


def _count(block_ids: BlockIds) -> int:
    if isinstance(block_ids, tuple):
        return sum(b != RELEASED for ids in block_ids for b in ids)
    return len(block_ids)


def _pairs(hold: _Hold, body: dict) -> tuple[list[list[int]], list[list[int]]]:
    """The blocks a push moves, source and destination, per block-table group: with one group the
    hold's from `first_block` on, as many as `dst_blocks`; with several, each entry the decode
    side's tables name (`dst_group_blocks`, `RELEASED` for none) from the hold's same entry."""
    grouped = isinstance(hold.block_ids, tuple)
    if grouped != ("dst_group_blocks" in body):
        kind = "per block-table group" if grouped else "in one block table"
        raise KvTransferError(f"transfer {hold.transfer_id!r}: its blocks are held {kind} here", "layout")
    if not isinstance(hold.block_ids, tuple):
        first, dst = int(body["first_block"]), [int(b) for b in body["dst_blocks"]]
        src = hold.block_ids[first : first + len(dst)]
        if len(src) != len(dst):
            raise KvTransferError(
                f"asked for {len(dst)} blocks from block {first}; {len(hold.block_ids)} are held", "refused"
            )
        return [src], [dst]
    tables = [[int(b) for b in ids] for ids in body["dst_group_blocks"]]
    if len(tables) != len(hold.block_ids):
        raise KvTransferError(f"{len(tables)} block-table groups asked for, {len(hold.block_ids)} held", "layout")
    src_groups, dst_groups = [], []
    for held, table in zip(hold.block_ids, tables, strict=True):
        wanted = [i for i, b in enumerate(table) if b != RELEASED]
        if any(i >= len(held) or held[i] == RELEASED for i in wanted):
            raise KvTransferError(f"transfer {hold.transfer_id!r} asks for blocks past the prompt's mark", "refused")
        src_groups.append([held[i] for i in wanted])
        dst_groups.append([table[i] for i in wanted])
    return src_groups, dst_groups
