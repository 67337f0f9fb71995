"""The scheduler with prefix caching: admission at the cached offset, one computation of a prefix
shared by a burst, the counts for /metrics, and a random workload (shared prefixes, a tight pool,
preemption, aborts, chunked prefill) run against a fake KV pool that checks every slot a step
reads holds what the request's own tokens would have written there."""

from __future__ import annotations

import random

import pytest
from helpers.clock import TickingClock
from helpers.scheduler import EOS, RecordingScheduler, shared_prefix_workload, token_for
from helpers.scheduler import run_step as step

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, RequestStatus, SchedulerConfig, SchedulerOutput


def make_scheduler(**overrides) -> RecordingScheduler:
    fields = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_kv_blocks=64)
    return RecordingScheduler(SchedulerConfig(**(fields | overrides)), clock=TickingClock())


def make_request(request_id: str, tokens: list[int], max_tokens: int = 3) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0)


class FakeKV:
    """A KV pool whose slots remember the tokens that wrote them: slot -> the writing sequence's
    tokens up to and including that position, which is what its K/V would depend on."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, ...]] = {}

    def slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, scheduler: RecordingScheduler, output: SchedulerOutput) -> None:
        """Check every context slot before the step writes any (a step must not read what it
        writes), then write the new tokens' slots, never one slot twice."""
        for s in output.scheduled:
            tokens = scheduler.added[s.request_id].all_token_ids
            for position in range(s.start_position):
                slot = self.slot(s.block_ids, position)
                assert self.slots.get(slot) == tuple(tokens[: position + 1]), f"{s.request_id}: stale KV at {position}"
        written: set[int] = set()
        for s in output.scheduled:
            tokens = scheduler.added[s.request_id].all_token_ids
            for position in range(s.start_position, s.start_position + len(s.token_ids)):
                slot = self.slot(s.block_ids, position)
                assert slot not in written, "two sequences wrote one slot in a step"
                written.add(slot)
                self.slots[slot] = tuple(tokens[: position + 1])


def test_a_request_sharing_a_finished_prompt_starts_after_the_cached_blocks():
    scheduler = make_scheduler()
    prefix = list(range(10, 20))  # two full blocks of 4, and 2 tokens more
    scheduler.add_request(make_request("first", prefix + [1, 2]))
    first = step(scheduler)
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (12, 0)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    scheduler.add_request(make_request("second", prefix + [3, 4, 5]))
    output = step(scheduler)
    ((scheduled,),) = [output.scheduled]
    assert (scheduled.start_position, scheduled.token_ids) == (8, [18, 19, 3, 4, 5])
    assert (output.prefix_cache_queries, output.prefix_cache_hits) == (13, 8)


def test_a_burst_sharing_a_prefix_computes_it_once():
    scheduler = make_scheduler()
    prefix = list(range(10, 26))  # four full blocks
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", prefix + [i, i]))
    first = step(scheduler)
    assert [s.request_id for s in first.scheduled] == ["r0"]  # the others wait one step for its blocks
    second = step(scheduler)
    admitted = [(s.request_id, s.start_position, len(s.token_ids)) for s in second.scheduled if s.request_id != "r0"]
    assert admitted == [("r1", 16, 2), ("r2", 16, 2), ("r3", 16, 2)]
    assert second.prefix_cache_hits == 3 * 16


def test_without_prefix_caching_every_prompt_is_computed_and_nothing_is_counted():
    scheduler = make_scheduler(enable_prefix_caching=False)
    prefix = list(range(10, 26))
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", prefix + [i]))
    output = step(scheduler)
    assert [(s.start_position, len(s.token_ids)) for s in output.scheduled] == [(0, 17), (0, 17)]
    assert (output.prefix_cache_queries, output.prefix_cache_hits) == (0, 0)


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    scheduler = make_scheduler(max_model_len=16, block_size=2, num_kv_blocks=8, max_num_batched_tokens=16)
    kv = FakeKV(2)
    scheduler.add_request(make_request("old", [50, 51, 52, 53], max_tokens=8))
    scheduler.add_request(make_request("new", [60, 61, 62, 63], max_tokens=8))
    new = scheduler.added["new"]
    while not new.num_preemptions:
        step(scheduler, kv)
    resumed = None
    while resumed is None:
        output = step(scheduler, kv)
        resumed = next((s for s in output.scheduled if s.request_id == "new"), None)
    assert resumed.start_position > 0  # old's decodes evicted some of new's blocks, not all
    while scheduler.has_unfinished_requests():
        step(scheduler, kv)
    assert new.output_token_ids == [token_for("new", 4 + i) for i in range(8)]


def check_blocks(scheduler: RecordingScheduler) -> None:
    """Waiting requests hold nothing; the manager's count of blocks in use is the distinct blocks
    running requests hold (shared ones once)."""
    held: set[int] = set()
    for request in scheduler.added.values():
        if request.status is RequestStatus.RUNNING:
            assert len(request.block_ids) * scheduler.config.block_size >= request.num_computed_tokens
            held.update(request.block_ids)
        elif not request.status.is_finished:
            assert request.block_ids == [] and request.num_computed_tokens == 0
    assert scheduler.block_manager.num_used_blocks == len(held)


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_reads_only_kv_its_own_tokens_wrote(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    max_model_len = 48
    chunked = rng.random() < 0.7
    scheduler = make_scheduler(
        max_num_seqs=rng.randint(2, 6),
        max_num_batched_tokens=rng.randint(8, 40) if chunked else 64,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=rng.randint(1, 2) * max_model_len // block_size,  # tight: preemption and eviction
        enable_chunked_prefill=chunked,
        policy=rng.choice(["fcfs", "slo"]),
    )
    kv = FakeKV(block_size)

    def checked_step() -> SchedulerOutput:
        output = step(scheduler, kv)
        check_blocks(scheduler)
        return output

    hits = shared_prefix_workload(scheduler, rng, checked_step)
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    assert hits > 0
    for request in scheduler.added.values():
        if request.finish_reason == "length":
            start, outputs = request.num_prompt_tokens, request.output_token_ids
            assert outputs == [token_for(request.request_id, start + i) for i in range(len(outputs))]
