"""A decode instance's KV loads without servers: the scheduler admits a request to wait for its KV
through its one allocation path, and the coordinator ends every load (pushed, refused, malformed,
late, or broken on this side) with the request resumed or recomputed and no block left behind."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moeserve.kv_transfer.agent import KvRegistration, KvTransferError
from moeserve.kv_transfer.config import KvTransferConfig
from moeserve.kv_transfer.coordinator import KvCoordinator, _Hold, _pairs
from moeserve.kv_transfer.layout import KvLayout
from moeserve.sampling_params import KvTransferParams, SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, RequestStatus, Scheduler, SchedulerConfig

BLOCK = 4


def _request(request_id: str, tokens: list[int], remote: str | None = None, max_tokens: int = 4) -> Request:
    kv = None if remote is None else KvTransferParams(f"xfer-{request_id}", remote)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, kv_transfer=kv)
    return Request(request_id, list(tokens), params, (0,), time.monotonic())


def _config(num_blocks: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=4, max_model_len=num_blocks * BLOCK, block_size=BLOCK, num_kv_blocks=num_blocks,
        enable_prefix_caching=True,
    )  # fmt: skip


def _run(scheduler: Scheduler) -> None:
    """Run what is scheduled through prefill and one decode, sampling token 7 each time."""
    for _ in range(2):
        plan = scheduler.schedule()
        scheduler.update(plan, {s.request_id: 7 for s in plan.scheduled if s.sample})


def test_a_load_never_writes_into_the_cached_prefix_it_shares():
    """The review's case: 4 blocks, a 2-block prefix cached but free, the other 2 held by a
    running request. A 13-token request needs one more block than the 2 free ones it would share:
    it waits, holding nothing, instead of being handed a cached block to write into."""
    scheduler = Scheduler(_config(4))
    prefix = list(range(100, 108))
    first = _request("first", [*prefix, 1], max_tokens=1)
    scheduler.add_request(first)
    _run(scheduler)
    assert first.status is RequestStatus.FINISHED_LENGTH and scheduler.block_manager.num_cached_blocks == 2
    cached = scheduler.block_manager.lookup(_request("probe", [*prefix, 9, 9, 9, 9, 9]))
    holder = _request("holder", list(range(200, 205)), max_tokens=3)
    scheduler.add_request(holder)
    scheduler.update(scheduler.schedule(), {"holder": 7})  # holds 2 blocks, decoding

    loaded = _request("loaded", [*prefix, 1, 2, 3, 4, 5], remote="127.0.0.1:9", max_tokens=1)
    scheduler.add_request(loaded)
    plan = scheduler.schedule()
    assert plan.kv_loads == [] and loaded.block_ids == []  # too few free blocks: it waits
    scheduler.update(plan, {"holder": 7})
    plan = scheduler.schedule()  # the holder's last token frees its blocks this step
    scheduler.update(plan, {"holder": 7})
    assert holder.status.is_finished
    plan = scheduler.schedule()
    (order,) = plan.kv_loads
    assert order.first_block == 2 and loaded.block_ids[:2] == cached
    assert not set(order.block_ids) & set(cached), "a fresh block must never be a cached one"
    assert loaded.status is RequestStatus.WAITING_FOR_REMOTE_KV and scheduler.num_waiting == 1


def test_a_loaded_request_computes_only_its_last_block_and_its_blocks_become_a_cached_prefix():
    scheduler = Scheduler(_config(16))
    tokens = list(range(1, 14))  # three full blocks before the last token
    request = _request("r", tokens, remote="127.0.0.1:9")
    scheduler.add_request(request)
    plan = scheduler.schedule()
    assert plan.is_empty and [o.request_id for o in plan.kv_loads] == ["r"]
    assert scheduler.schedule().kv_loads == []  # a request loads once
    assert scheduler.finish_kv_load("r", loaded=True)
    plan = scheduler.schedule()
    (scheduled,) = plan.scheduled
    assert (scheduled.start_position, scheduled.token_ids, scheduled.sample) == (12, [13], True)
    assert plan.prefix_cache_hits == 12
    scheduler.update(plan, {"r": 7})
    assert scheduler.block_manager.lookup(_request("again", tokens)) == request.block_ids[:3]


def test_loaded_requests_never_wait_on_each_other_for_blocks():
    """Two loads fill the cache; once both are in, neither may sit in the queue holding its
    blocks while it needs one more (nothing running would ever free one): both finish."""
    scheduler = Scheduler(_config(6))
    requests = [
        _request(f"r{i}", list(range(10 * i + 1, 10 * i + 14)), remote="127.0.0.1:9", max_tokens=2) for i in (0, 1)
    ]
    for request in requests:
        scheduler.add_request(request)
    assert len(scheduler.schedule().kv_loads) == 2 and scheduler.block_manager.num_free_blocks == 0
    for request in requests:
        assert scheduler.finish_kv_load(request.request_id, loaded=True)
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        assert not plan.is_empty, "queued requests wait for blocks only running ones could free"
        scheduler.update(plan, {s.request_id: 7 for s in plan.scheduled if s.sample})
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests)
    assert scheduler.block_manager.num_used_blocks == 0


def test_a_failed_load_recomputes_the_prompt_with_its_blocks_given_back():
    scheduler = Scheduler(_config(16))
    request = _request("r", list(range(1, 14)), remote="127.0.0.1:9")
    scheduler.add_request(request)
    scheduler.schedule()
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.finish_kv_load("r", loaded=False)
    assert scheduler.block_manager.num_used_blocks == 0 and scheduler.block_manager.lookup(request) == []
    (scheduled,) = scheduler.schedule().scheduled
    assert (scheduled.start_position, len(scheduled.token_ids)) == (0, 13)
    assert not scheduler.finish_kv_load("r", loaded=True)  # no longer waiting for one


class _FakePrefill:
    """A side channel answering every push with `reply` (status, body bytes) after `delay_s`."""

    def __init__(self, status: int, body: bytes, delay_s: float = 0.0) -> None:
        fake = self
        self.pushes: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                fake.pushes.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                time.sleep(delay_s)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def decode_side() -> Iterator[tuple[KvCoordinator, DataParallelScheduler]]:
    scheduler = DataParallelScheduler(_config(16))
    registration = KvRegistration("fake-decode", b"", (KvLayout((0,), 1, 16 * BLOCK * 8, BLOCK * 8),))
    config = KvTransferConfig(role="decode", backend="nixl", timeout_s=0.5)
    coordinator = KvCoordinator(config, scheduler, [registration], [])
    yield coordinator, scheduler
    coordinator.close()


def _start(coordinator: KvCoordinator, scheduler: DataParallelScheduler, remote: str) -> Request:
    request = _request("r", list(range(1, 14)), remote=remote)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    (order,) = plan.groups[0].kv_loads
    coordinator.start_load(order, 0, request)
    return request


def _settle_until(coordinator: KvCoordinator, done, timeout_s: float = 10.0) -> list[str]:
    failed: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the load never ended"
        coordinator.wait(0.02)
        failed += coordinator.settle()
    return failed


def _sample(coordinator: KvCoordinator, name: str, **labels: str) -> float:
    value = coordinator.stats.registry.get_sample_value(name, {"role": "decode", **labels})
    assert value is not None, name
    return value


def _gauges(coordinator: KvCoordinator) -> tuple[float, float]:
    """(transfers in flight, blocks held for transfers)"""
    in_flight = _sample(coordinator, "moeserve:kv_transfers_in_flight")
    return in_flight, _sample(coordinator, "moeserve:kv_transfer_held_blocks")


def _failures(coordinator: KvCoordinator, cause: str) -> float:
    return _sample(coordinator, "moeserve:kv_transfer_failures_total", cause=cause)


@pytest.mark.parametrize(
    ("status", "body", "cause"),
    [
        (200, b"{}", "malformed"),  # a 200 that says nothing of bytes
        (200, b"<html>oops</html>", "malformed"),
        (200, b"[1, 2]", "malformed"),
        (500, b'{"error": "it broke", "cause": "internal"}', "internal"),
        (409, b'{"error": "nothing held", "cause": "refused"}', "refused"),
    ],
)
def test_a_bad_reply_ends_the_load_and_the_request_recomputes(decode_side, status, body, cause):
    coordinator, scheduler = decode_side
    fake = _FakePrefill(status, body)
    try:
        request = _start(coordinator, scheduler, fake.address)
        _settle_until(coordinator, lambda: not coordinator.busy)
    finally:
        fake.close()
    assert request.status is RequestStatus.WAITING and request.num_computed_tokens == 0
    assert scheduler.num_used_blocks == 0 and _gauges(coordinator) == (0, 0)
    assert _failures(coordinator, cause) == 1
    (push,) = fake.pushes
    assert push["write_by"] < time.time() + 0.5 and push["first_block"] == 0 and len(push["dst_blocks"]) == 3


@pytest.mark.parametrize("pushed", [True, False], ids=["pushed", "refused"])
def test_a_state_model_loads_the_prompts_state_into_a_saved_slot_and_resumes_from_it(pushed):
    config = replace(_config(16), has_state=True, num_saved_states=2)
    scheduler = DataParallelScheduler(config)
    registration = KvRegistration("fake-decode", b"", (KvLayout((0,), 1, 16 * BLOCK * 8, BLOCK * 8),))
    coordinator = KvCoordinator(KvTransferConfig(role="decode", backend="nixl"), scheduler, [registration], [])
    fake = _FakePrefill(200, b'{"bytes": 1}') if pushed else _FakePrefill(409, b'{"error": "no", "cause": "refused"}')
    try:
        request = _start(coordinator, scheduler, fake.address)
        _settle_until(coordinator, lambda: not coordinator.busy)
    finally:
        coordinator.close()
        fake.close()
    (push,) = fake.pushes
    saved = scheduler.groups[0].block_manager.saved_states
    assert push["dst_state"] >= 0 and saved.num_held == int(pushed)
    (scheduled,) = scheduler.schedule().groups[0].scheduled
    if pushed:  # admission resumes from the loaded state, past the loaded blocks
        assert (scheduled.start_position, scheduled.load_state) == (12, push["dst_state"])
    else:
        assert (scheduled.start_position, scheduled.load_state) == (0, -1)
    assert request.status is RequestStatus.RUNNING


def test_an_exception_in_the_load_thread_fails_the_load_instead_of_killing_it(decode_side, monkeypatch):
    coordinator, scheduler = decode_side

    def explode(*args: object) -> dict:
        raise RuntimeError("not a transfer error")

    monkeypatch.setattr("moeserve.kv_transfer.coordinator.request_push", explode)
    request = _start(coordinator, scheduler, "127.0.0.1:9")
    _settle_until(coordinator, lambda: not coordinator.busy)
    assert request.status is RequestStatus.WAITING and scheduler.num_used_blocks == 0
    assert _failures(coordinator, "internal") == 1
    assert _gauges(coordinator) == (0, 0)


def test_a_late_push_keeps_its_blocks_pinned_until_the_prefill_side_answers(decode_side):
    """The request stops waiting at its deadline and recomputes in other blocks; the blocks the
    push writes into stay out of everyone's reach until the prefill side says it is over."""
    coordinator, scheduler = decode_side
    fake = _FakePrefill(409, b'{"error": "cancelled at its deadline", "cause": "timeout"}', delay_s=1.5)
    try:
        request = _start(coordinator, scheduler, fake.address)
        target = list(request.block_ids)
        _settle_until(coordinator, lambda: request.status is RequestStatus.WAITING)
        assert time.monotonic() - request.arrival_time < 1.2  # gave up at its 0.5 s deadline, not at the answer
        blocks = scheduler.groups[0].block_manager
        assert blocks.num_used_blocks == 3 and _gauges(coordinator)[1] == 3  # pinned by the load alone
        plan = scheduler.schedule()  # the recompute takes other blocks
        assert not set(plan.scheduled[0].block_ids) & set(target)
        _settle_until(coordinator, lambda: not coordinator.busy)
    finally:
        fake.close()
    assert _gauges(coordinator) == (0, 0)
    assert _failures(coordinator, "timeout") == 1  # counted once


GROUPS = (((1, 8), 40), ((4, None), 16), ((16, None), 6))
"""DeepSeek-V4's kinds at block 4: a window of 8, entries of 4 and of 16 positions; hits every 64."""


def _grouped(**fields) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=2, max_model_len=256, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=64,
            enable_prefix_caching=True, has_state=True, num_saved_states=4, block_groups=GROUPS, **fields,
        )
    )  # fmt: skip


def _finish_loads(scheduler: Scheduler, loaded: bool) -> list:
    """What the coordinator does with the plan's loads: pin, end (slot committed or not), resume."""
    manager, orders = scheduler.block_manager, scheduler.schedule().kv_loads
    for order in orders:
        manager.pin(order.group_block_ids)
        manager.unpin(order.group_block_ids)
        manager.saved_states.end_load(order.state_slot, loaded)
        assert scheduler.finish_kv_load(order.request_id, loaded)
    return orders


def test_grouped_loads_move_every_groups_blocks_to_the_mark_and_resume_from_a_hit_there():
    """The prefill side pins each group's blocks a hit at the prompt's mark (128 of 150) reads and
    the open windows' state saved there; the decode side allocates the same entries fresh (none
    of the window's dead at the mark), resumes from them as from a hit, and, for a longer prompt
    sharing them, writes only past that cached prefix. Nothing stays held on either side."""
    tokens = [3 + i % 50 for i in range(150)]
    prefill = _grouped()
    held = _request("p", tokens, max_tokens=1)
    held.kv_hold_id = "xfer-p"
    prefill.add_request(held)
    while prefill.has_unfinished_requests():
        _run(prefill)
    ((transfer_id, tables, slot),) = prefill.kv_holds
    window, entries_4, entries_16 = tables
    assert (transfer_id, len(window), len(entries_4), len(entries_16)) == ("xfer-p", 32, 8, 2)
    assert window[:30] == (-1,) * 30 and -1 not in window[30:] + entries_4 + entries_16
    manager = prefill.block_manager
    assert slot >= 0 and manager.num_used_blocks == 12  # pinned, the request gone
    manager.unpin(tables)
    manager.saved_states.unpin(slot)
    assert manager.num_used_blocks == 0

    decode = _grouped()
    decode.add_request(_request("d", tokens, remote="127.0.0.1:9", max_tokens=2))
    (order,) = _finish_loads(decode, loaded=True)
    assert order.block_ids == [] and [len(t) for t in order.group_block_ids] == [32, 8, 2]
    assert order.group_block_ids[0][:30] == (-1,) * 30 and order.state_slot >= 0
    plan = decode.schedule()
    assert plan.prefix_cache_hits == 128 and plan.scheduled[0].start_position == 128
    assert plan.scheduled[0].load_state == order.state_slot
    decode.update(plan, {"d": 7})
    while decode.has_unfinished_requests():
        _run(decode)

    longer = [*tokens[:128], *range(60, 140)]  # mark 192, the first 128 positions cached
    decode.add_request(_request("e", longer, remote="127.0.0.1:9", max_tokens=1))
    (order,) = _finish_loads(decode, loaded=True)
    window, entries_4, entries_16 = order.group_block_ids
    assert window[:46] == (-1,) * 46 and -1 not in window[46:]
    assert entries_4[:8] == (-1,) * 8 and -1 not in entries_4[8:] and entries_16 == (-1, -1, entries_16[2])
    plan = decode.schedule()
    assert plan.prefix_cache_hits == 192 and plan.scheduled[0].start_position == 192
    decode.update(plan, {"e": 7})
    assert not decode.has_unfinished_requests() and decode.block_manager.num_used_blocks == 0


def test_a_failed_grouped_load_frees_its_blocks_and_slot_and_recomputes():
    decode = _grouped()
    decode.add_request(_request("d", [3 + i % 50 for i in range(150)], remote="127.0.0.1:9", max_tokens=1))
    (order,) = _finish_loads(decode, loaded=False)
    saved = decode.block_manager.saved_states
    assert order.state_slot >= 0 and saved.num_held == 0 and decode.block_manager.num_used_blocks == 0
    plan = decode.schedule()
    assert plan.prefix_cache_hits == 0 and plan.scheduled[0].start_position == 0


def test_a_grouped_push_pairs_each_groups_entries_and_refuses_what_was_not_held():
    hold = _Hold("xfer", 0, ((-1, -1, 5, 6), (1, 2), ()), deadline=0.0)
    src, dst = _pairs(hold, {"dst_group_blocks": [[-1, -1, -1, 9], [7, -1], []]})
    assert (src, dst) == ([[6], [1], []], [[9], [7], []])  # the cached entry (-1) is not written
    with pytest.raises(KvTransferError, match="past the prompt's mark") as refused:
        _pairs(hold, {"dst_group_blocks": [[-1, 3, -1, -1], [], []]})  # behind the window here
    assert refused.value.cause == "refused"
    with pytest.raises(KvTransferError, match="held per block-table group") as mixed:
        _pairs(hold, {"first_block": 0, "dst_blocks": [4]})  # a one-group peer
    assert mixed.value.cause == "layout"
