"""The KV transfer's part in the engine core: what a prefill instance holds, what a decode
instance loads, and when their blocks go back to the free list. Everything that touches a block
manager runs on the core's thread; the side channel's threads and the load threads only hand
results over (under `_lock`), and wake the core.

Prefill role: a request carrying `kv_transfer` finishes after its prompt (the router asks for one
token) with its prompt's full blocks pinned (`Request.kv_hold_id`). They stay pinned until a
decode instance's push has written them out, or `timeout_s` passes without one.

Decode role: a request carrying `kv_transfer` with a `remote` first takes its data-parallel group's
cached prefix and pre-allocates blocks for the rest of its prompt's full blocks, then asks the
prefill instance to push them (on its own thread; the core steps on meanwhile). Once they are in,
the blocks are registered in the group's prefix cache and the request is queued in that group,
whose admission finds them there: it computes only the last partial block (at least its last
prompt token, whose logits give the first output token, exactly as after a prefix cache hit). On
a failure the blocks are freed and the request is recomputed here or failed
(`load_failure_policy`). Pins last until the request is first scheduled or ends.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from moeserve.kv_transfer.agent import KvRegistration, KvTransferError
from moeserve.kv_transfer.config import KvTransferConfig
from moeserve.kv_transfer.rank_writer import KvWriter
from moeserve.kv_transfer.side_channel import SideChannel, request_push
from moeserve.kv_transfer.stats import KvTransferStats
from moeserve.scheduler import DataParallelScheduler, Request

logger = logging.getLogger(__name__)

PUSH_DEADLINE_SHARE = 0.8
"""A push must have written its blocks within this share of the decode side's wait, so that it
never writes into blocks the decode side has freed after giving up."""


@dataclass
class _Hold:
    transfer_id: str
    group: int
    block_ids: list[int]
    deadline: float


@dataclass
class _Load:
    request: Request
    remote: str
    group: int
    block_ids: list[int]
    """The group's cached prefix (pinned), then the blocks reserved for what is fetched."""
    num_cached: int
    started: float
    error: KvTransferError | None = None
    num_bytes: int = 0
    aborted: bool = False


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
        self._loads: dict[str, _Load] = {}  # decode: by request id, loading
        self._loaded: list[_Load] = []  # decode: ended, to settle
        self._pinned: dict[str, tuple[int, list[int]]] = {}  # decode: queued after a load, until scheduled
        self._in_flight = 0
        push = self._push if config.role == "prefill" else None
        self.side_channel = SideChannel(config.host, config.port, self.stats.exposition, push)

    def close(self) -> None:
        self.side_channel.close()

    @property
    def busy(self) -> bool:
        """Blocks are held or loading: the core must keep turning to release or admit them."""
        return bool(self._holds or self._pushed or self._loads or self._loaded or self._pinned)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a push or a load ends, or `timeout_s` (the core has nothing else to do)."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    # ---- requests coming in ------------------------------------------------------------------

    def take(self, request: Request) -> bool:
        """Mark a prefill request to hold its KV; start a decode request's load. True when the
        request is now loading (the core queues it later), False when it goes to the scheduler."""
        params = request.sampling_params.kv_transfer
        if params is None:
            return False
        if self.config.role == "prefill":
            request.kv_hold_id = params.transfer_id
            return False
        if params.remote is None:
            raise ValueError("kv_transfer_params on a decode instance need the prefill instance's address")
        group = self.scheduler.choose_group(request)
        blocks = self.scheduler.groups[group].block_manager
        num_full = (request.num_prompt_tokens - 1) // blocks.block_size
        cached = blocks.lookup(request)[:num_full]
        # With the whole prompt cached here the push moves nothing, but still tells the prefill
        # side that its blocks can go.
        fresh = blocks.reserve(num_full - len(cached))
        if fresh is None:
            self.stats.failed("no_blocks")
            logger.warning("no free KV blocks to load %s into; it is recomputed here", request.request_id)
            return False
        blocks.pin(cached)
        load = _Load(request, params.remote, group, cached + fresh, len(cached), time.monotonic())
        self._loads[request.request_id] = load
        self._count_in_flight(+1)
        body = {
            "transfer_id": params.transfer_id,
            "dest": self.registrations[group].to_json(),
            "dst_blocks": fresh,
            "first_block": len(cached),
            "timeout_s": self.config.timeout_s,
        }
        threading.Thread(target=self._run_load, args=(load, body), name="kv-load", daemon=True).start()
        return True

    def _run_load(self, load: _Load, body: dict) -> None:
        try:
            load.num_bytes = request_push(load.remote, body, self.config.timeout_s)["bytes"]
        except KvTransferError as exc:
            load.error = exc
        with self._lock:
            self._loaded.append(load)
        self._count_in_flight(-1)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """A client's abort: a loading request is dropped once its load ends; a queued one's pins go."""
        load = self._loads.get(request_id)
        if load is not None:
            load.aborted = True
        self.scheduled([request_id])

    # ---- the core's turn ---------------------------------------------------------------------

    def collect_holds(self) -> None:
        """Take over the blocks finished prefill requests left pinned, until pushed or expired."""
        deadline = time.monotonic() + self.config.timeout_s
        with self._lock:
            for g, group in enumerate(self.scheduler.groups):
                for transfer_id, block_ids in group.kv_holds:
                    self._holds[transfer_id] = _Hold(transfer_id, g, block_ids, deadline)
                group.kv_holds.clear()
        self._report_held()

    def settle(self) -> list[str]:
        """Release what is done with, queue what has loaded; the ids of requests that end failed."""
        self.collect_holds()
        now = time.monotonic()
        with self._lock:
            expired = [h for h in self._holds.values() if h.deadline < now]
            for hold in expired:
                del self._holds[hold.transfer_id]
                logger.warning("no decode instance pulled transfer %s in time; its KV is freed", hold.transfer_id)
                self.stats.failed("timeout")
            released, self._pushed = self._pushed + expired, []
            loaded, self._loaded = self._loaded, []
        for hold in released:
            self.scheduler.groups[hold.group].block_manager.unpin(hold.block_ids)
        failed = [load.request.request_id for load in loaded if not self._settle_load(load)]
        self._report_held()
        return failed

    def _settle_load(self, load: _Load) -> bool:
        """Queue a loaded request (or one to recompute); False when it ends failed."""
        request = load.request
        del self._loads[request.request_id]
        blocks = self.scheduler.groups[load.group].block_manager
        if load.aborted:
            blocks.unpin(load.block_ids)
            return True
        if load.error is None:
            self.stats.transferred(load.num_bytes, time.monotonic() - load.started)
            blocks.cache_loaded_blocks(request, load.block_ids)
            self._pinned[request.request_id] = (load.group, load.block_ids)
            return self._queue(request, load.group)
        blocks.unpin(load.block_ids)
        self.stats.failed(load.error.cause)
        if self.config.load_failure_policy == "fail":
            logger.error("KV load of %s failed: %s", request.request_id, load.error)
            return False
        logger.warning("KV load of %s failed (%s); recomputing it here", request.request_id, load.error)
        return self._queue(request, None)

    def _queue(self, request: Request, group: int | None) -> bool:
        try:
            self.scheduler.add_request(request, slo_admission=False, group=group)
        except (ValueError, RuntimeError) as exc:  # a queue filled while it loaded
            logger.error("could not queue %s after its KV load: %s", request.request_id, exc)
            self.scheduled([request.request_id])
            return False
        return True

    def scheduled(self, request_ids: list[str]) -> None:
        """Requests first scheduled (or gone): their admission took its own references."""
        for request_id in request_ids:
            pinned = self._pinned.pop(request_id, None)
            if pinned is not None:
                self.scheduler.groups[pinned[0]].block_manager.unpin(pinned[1])

    # ---- prefill: a decode instance's push (side channel thread) -------------------------------

    def _push(self, body: dict) -> dict:
        # The decode side frees its blocks when it stops waiting: a write must never start after
        # that, and must end well before it (a late write would land in blocks reused since).
        deadline = time.monotonic() + float(body["timeout_s"]) * PUSH_DEADLINE_SHARE
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
            first, dst_blocks = int(body["first_block"]), [int(b) for b in body["dst_blocks"]]
            src_blocks = hold.block_ids[first : first + len(dst_blocks)]
            if len(src_blocks) != len(dst_blocks):
                raise KvTransferError(
                    f"asked for {len(dst_blocks)} blocks from block {first}; {len(hold.block_ids)} are held", "refused"
                )
            left_s = deadline - time.monotonic()
            if not dst_blocks:
                return {"bytes": 0, "seconds": 0.0}
            if left_s <= 0:
                raise KvTransferError(
                    f"transfer {transfer_id!r} came too late: the decode side has given up", "timeout"
                )
            dest = KvRegistration.from_json(body["dest"])
            num_bytes = self.writers[hold.group].write(dest, src_blocks, dst_blocks, left_s)
        except KvTransferError as exc:
            self.stats.failed(exc.cause)
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
            held = sum(len(h.block_ids) for h in self._holds.values())
        held += sum(len(load.block_ids) for load in self._loads.values())
        held += sum(len(ids) for _, ids in self._pinned.values())
        self.stats.set_held_blocks(held)
