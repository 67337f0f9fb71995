"""Scheduler: continuous batching, chunked prefill, preemption by recompute, aborts, stop rules.

Every test drives the scheduler the way the engine does (schedule -> fake runner -> update) and
checks the invariants after each step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from helpers.clock import TickingClock
from helpers.scheduler import EOS, RecordingScheduler, check_output, make_request, token_for

from moeserve.scheduler import QueueFullError, Request, RequestStatus, SchedulerConfig, SchedulerOutput, StepShape


def make_config(**overrides) -> SchedulerConfig:
    """Prefix caching off: these tests pin recompute and one owner per block (test_prefix_caching.py
    covers the cache)."""
    fields = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        num_kv_blocks=64,
        enable_prefix_caching=False,
    )
    return SchedulerConfig(**(fields | overrides))


def make_scheduler(**overrides) -> RecordingScheduler:
    return RecordingScheduler(make_config(**overrides), clock=TickingClock())


def step(
    scheduler: RecordingScheduler, sample: Callable[[str, int], int] = token_for
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step with a fake runner; `sample(request_id, position)` picks each new token."""
    output = scheduler.schedule()
    check_output(scheduler, output)
    sampled = {
        s.request_id: sample(s.request_id, s.start_position + len(s.token_ids)) for s in output.scheduled if s.sample
    }
    finished = scheduler.update(output, sampled)
    return output, finished


def run_to_completion(scheduler: RecordingScheduler, max_steps: int = 1000, **kwargs) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(step(scheduler, **kwargs)[0])
    return outputs


def check_state(scheduler: RecordingScheduler, request_ids: list[str]) -> None:
    """Blocks: each live request owns its own, running ones cover their computed tokens, and the
    manager's counts add up. Queued requests hold nothing. `request_ids` in arrival order."""
    manager = scheduler.block_manager
    owned: list[int] = []
    running: list[Request] = []
    num_waiting = 0
    for request_id in request_ids:  # in arrival order
        if not scheduler.is_live(request_id):
            continue
        request = scheduler.added[request_id]
        if request.status is RequestStatus.RUNNING:
            running.append(request)
            assert len(request.block_ids) * manager.block_size >= request.num_computed_tokens
        else:
            num_waiting += 1
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.block_ids == [] and request.num_computed_tokens == 0
        owned += request.block_ids
    assert len(owned) == len(set(owned)), "a block is held by two requests"
    assert manager.num_used_blocks == len(owned)
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
    assert (scheduler.num_running, scheduler.num_waiting) == (len(running), num_waiting)
    prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
    assert prefilling in ([], running[-1:]), "only the newest running request may be mid-prefill"
    assert scheduler.num_running <= scheduler.config.max_num_seqs


# ----- config -----


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_num_seqs=0),
        dict(block_size=0),
        dict(max_waiting=0),
        dict(max_num_seqs=65, max_num_batched_tokens=64),  # decodes could not all fit a step
        dict(enable_chunked_prefill=False, max_num_batched_tokens=32),  # a long prompt never fits
        dict(num_kv_blocks=15),  # one max_model_len sequence needs 16 blocks of 4
    ],
)
def test_config_rejects_limits_that_could_deadlock(overrides):
    with pytest.raises(ValueError):
        make_config(**overrides)


def test_config_accepts_exactly_one_full_sequence():
    assert make_config(num_kv_blocks=16).max_blocks_per_seq == 16


# ----- admission and continuous batching -----


def test_new_request_joins_the_running_batch_at_the_next_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=10))
    out, _ = step(scheduler)
    assert [(s.request_id, len(s.token_ids), s.start_position) for s in out.scheduled] == [("a", 5, 0)]
    scheduler.add_request(make_request("b", prompt_len=3))
    out, _ = step(scheduler)
    assert [(s.request_id, len(s.token_ids), s.start_position) for s in out.scheduled] == [("a", 1, 5), ("b", 3, 0)]
    assert all(s.sample for s in out.scheduled)
    out, _ = step(scheduler)
    assert [(s.request_id, s.start_position) for s in out.scheduled] == [("a", 6), ("b", 3)]
    check_state(scheduler, ["a", "b"])


def test_max_num_seqs_caps_the_running_batch_and_admission_is_fcfs():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, max_tokens=2))
    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    out, finished = step(scheduler)
    assert {r.request_id for r in finished} == {"a", "b"}
    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["c"]


def test_finished_requests_leave_at_once_and_free_their_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("short", prompt_len=4, max_tokens=1))
    scheduler.add_request(make_request("long", prompt_len=4, max_tokens=5))
    _, finished = step(scheduler)
    assert [r.request_id for r in finished] == ["short"]
    short = finished[0]
    assert short.status is RequestStatus.FINISHED_LENGTH and short.finish_reason == "length"
    assert short.block_ids == [] and not scheduler.is_live("short")
    assert scheduler.block_manager.num_used_blocks == 1  # "long": 4 computed tokens, one block of 4
    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["long"]
    assert out.finished_request_ids == ["short"]
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_first_admission_is_stamped_by_the_clock_and_readmission_keeps_it():
    clock = TickingClock()
    config = make_config(max_model_len=16, block_size=2, num_kv_blocks=8, max_num_batched_tokens=16)
    scheduler = RecordingScheduler(config, clock)
    for request_id in ("old", "new"):
        scheduler.add_request(make_request(request_id, prompt_len=4, max_tokens=8))
    old, new = scheduler.added["old"], scheduler.added["new"]
    step(scheduler)  # the clock's only readings: 1 and 2, one per first admission
    assert (old.first_scheduled_time, new.first_scheduled_time) == (1.0, 2.0)
    run_to_completion(scheduler)
    assert new.num_preemptions >= 1 and new.first_scheduled_time == 2.0 and clock.now == 2.0


def test_schedule_twice_without_update_is_an_error():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="update"):
        scheduler.schedule()


def test_empty_scheduler_returns_an_empty_plan():
    scheduler = make_scheduler()
    out = scheduler.schedule()
    assert out.is_empty and out.num_batched_tokens == 0
    assert scheduler.schedule().is_empty  # an empty plan needs no update
    assert not scheduler.has_unfinished_requests()


# ----- chunked prefill -----


def test_chunked_prefill_splits_a_long_prompt_while_decodes_run_every_step():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    for request_id in "ab":
        scheduler.add_request(make_request(request_id, prompt_len=2, max_tokens=20))
    step(scheduler)
    scheduler.add_request(make_request("long", prompt_len=20, max_tokens=2))
    chunks = []
    while True:
        out, _ = step(scheduler)
        by_id = {s.request_id: s for s in out.scheduled}
        assert len(by_id["a"].token_ids) == len(by_id["b"].token_ids) == 1  # decodes never skipped
        assert [s.request_id for s in out.scheduled][:2] == ["a", "b"]  # decodes first
        long = by_id["long"]
        chunks.append((long.start_position, len(long.token_ids), long.sample))
        if long.sample:
            break
    assert chunks == [(0, 6, False), (6, 6, False), (12, 6, False), (18, 2, True)]
    assert scheduler.added["long"].num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", prompt_len=2, max_tokens=10))
    scheduler.add_request(make_request("b", prompt_len=2, max_tokens=10))
    scheduler.add_request(make_request("big", prompt_len=63, max_tokens=1))
    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]  # 60 tokens left: "big" waits whole
    out, _ = step(scheduler)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]  # 62 left: still too few
    scheduler.abort_request("a")
    out, finished = step(scheduler)
    assert [(s.request_id, len(s.token_ids)) for s in out.scheduled] == [("b", 1), ("big", 63)]
    assert [r.request_id for r in finished] == ["big"]


# ----- preemption -----


def test_preemption_recomputes_and_yields_the_full_sequence():
    # 8 blocks of 2 tokens: two requests growing to 12 tokens each can not both stay resident.
    scheduler = make_scheduler(max_model_len=16, block_size=2, num_kv_blocks=8, max_num_batched_tokens=16)
    ids = ["old", "new"]
    for request_id in ids:
        scheduler.add_request(make_request(request_id, prompt_len=4, max_tokens=8))
    old, new = (scheduler.added[request_id] for request_id in ids)
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs.append(step(scheduler)[0])
        check_state(scheduler, ids)
        if outputs[-1].preempted_request_ids and new.num_preemptions == 1:
            assert outputs[-1].preempted_request_ids == ["new"]  # the most recently arrived goes
            assert new.status is RequestStatus.PREEMPTED and new.block_ids == []
            assert 0 < new.num_output_tokens < 8  # its outputs are kept for the recompute
            assert [s.request_id for s in outputs[-1].scheduled] == ["old"]
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    introduced = [n.request_id for output in outputs for n in output.new_requests]
    assert introduced == ["old", "new"]  # once each: a readmitted request's runner state outlived its KV
    for request in (old, new):
        assert request.output_token_ids == [token_for(request.request_id, 4 + i) for i in range(8)]
        assert request.finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == 8


def test_resumed_request_recomputes_prompt_plus_outputs_from_position_zero():
    scheduler = make_scheduler(max_model_len=16, block_size=2, num_kv_blocks=8, max_num_batched_tokens=16)
    for request_id in ("old", "new"):
        scheduler.add_request(make_request(request_id, prompt_len=4, max_tokens=8))
    new = scheduler.added["new"]
    while not new.num_preemptions:
        step(scheduler)
    while True:
        output = scheduler.schedule()
        resumed = [s for s in output.scheduled if s.request_id == "new"]
        if resumed:
            break
        scheduler.update(output, {s.request_id: 1 for s in output.scheduled if s.sample})
    (resumed,) = resumed
    assert (resumed.start_position, resumed.token_ids, resumed.sample) == (0, new.all_token_ids, True)


def test_a_request_can_preempt_itself_when_it_is_the_newest():
    # 4 blocks of 2, all used after the prefills. Next step "old" decodes position 3 inside its
    # second block, but "new" needs a third block for position 4 and is itself the newest.
    scheduler = make_scheduler(max_model_len=8, block_size=2, num_kv_blocks=4, max_num_batched_tokens=8)
    scheduler.add_request(make_request("old", prompt_len=3, max_tokens=5))
    scheduler.add_request(make_request("new", prompt_len=4, max_tokens=4))
    step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    out, _ = step(scheduler)
    assert out.preempted_request_ids == ["new"]
    assert [(s.request_id, s.start_position) for s in out.scheduled] == [("old", 3)]
    run_to_completion(scheduler)
    assert scheduler.block_manager.num_used_blocks == 0


# ----- abort and external finish -----


def test_a_plan_introduces_its_first_timers_with_what_sampling_needs():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", max_tokens=2, temperature=0.5, seed=3))
    scheduler.add_request(make_request("b", max_tokens=2))
    first, _ = step(scheduler)
    (new,) = first.new_requests
    a = scheduler.added["a"]
    assert (new.request_id, new.sampling_params, new.prompt_token_ids) == (
        "a",
        a.sampling_params,
        tuple(a.prompt_token_ids),
    )
    assert new.prompt_token_ids is not a.prompt_token_ids  # a snapshot: the plan may travel to other processes
    second, _ = step(scheduler)
    assert second.new_requests == [] and second.finished_request_ids == []
    third, _ = step(scheduler)
    assert [n.request_id for n in third.new_requests] == ["b"] and third.finished_request_ids == ["a"]


def test_update_teaches_the_step_time_model_only_timed_non_empty_steps():
    scheduler = make_scheduler(policy="slo")
    model, probe = scheduler.step_time_model, StepShape.of([(4, 0)])
    scheduler.add_request(make_request("a"))
    scheduler.update(scheduler.schedule(), {"a": 5})  # untimed
    assert model.predict(probe) == 0.0  # what it predicts before any observation
    scheduler.update(scheduler.schedule(), {"a": 5}, duration_s=0.01)
    learned = model.predict(probe)
    assert learned > 0.0
    scheduler.abort_request("a")
    empty = scheduler.schedule()
    assert empty.is_empty
    scheduler.update(empty, {}, duration_s=0.01)
    assert model.predict(probe) == learned


def test_abort_frees_blocks_at_once_and_is_reported_next_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=10))
    scheduler.add_request(make_request("b", max_tokens=10))
    step(scheduler)
    used = scheduler.block_manager.num_used_blocks
    a = scheduler.added["a"]
    held = len(a.block_ids)
    assert scheduler.abort_request("a")
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and scheduler.block_manager.num_used_blocks == used - held
    assert not scheduler.abort_request("a")
    out, _ = step(scheduler)
    assert out.finished_request_ids == ["a"]
    assert [s.request_id for s in out.scheduled] == ["b"]
    check_state(scheduler, ["a", "b"])


def test_abort_of_a_queued_request_and_of_one_in_flight():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("running", max_tokens=10))
    scheduler.add_request(make_request("queued"))
    output = scheduler.schedule()
    assert scheduler.abort_request("queued") and scheduler.num_waiting == 0
    assert scheduler.abort_request("running")  # while its step is on the device
    assert scheduler.update(output, {"running": 7}) == []
    assert scheduler.block_manager.num_used_blocks == 0
    assert not scheduler.has_unfinished_requests()


def test_finish_request_for_a_matched_stop_string():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=10))
    step(scheduler)
    assert scheduler.finish_request("a", "stop", stop_reason="###")
    assert scheduler.block_manager.num_used_blocks == 0
    out, _ = step(scheduler)
    assert out.is_empty and out.finished_request_ids == ["a"]
    with pytest.raises(ValueError, match="finish reason"):
        scheduler.finish_request("a", "bored")


# ----- stop rules -----


def run_one(request: Request, tokens: list[int], **config) -> Request:
    """Run `request` alone, sampling `tokens` in order; return it once finished."""
    scheduler = make_scheduler(**config)
    scheduler.add_request(request)
    stream = iter(tokens)
    run_to_completion(scheduler, sample=lambda _id, _pos: next(stream))
    assert scheduler.block_manager.num_used_blocks == 0
    return request


def test_max_tokens_finishes_with_length():
    request = run_one(make_request("a", max_tokens=3), [5, 6, 7, 8])
    assert request.output_token_ids == [5, 6, 7]
    assert (request.status, request.finish_reason, request.stop_reason) == (
        RequestStatus.FINISHED_LENGTH,
        "length",
        None,
    )


def test_eos_stops_and_is_kept_as_the_last_output():
    request = run_one(make_request("a", max_tokens=10), [5, EOS, 6])
    assert request.output_token_ids == [5, EOS]
    assert (request.status, request.finish_reason, request.stop_reason) == (
        RequestStatus.FINISHED_STOPPED,
        "stop",
        None,
    )


def test_eos_as_the_last_allowed_token_reports_stop():
    assert run_one(make_request("a", max_tokens=2), [5, EOS]).finish_reason == "stop"


def test_ignore_eos_generates_through_eos():
    request = run_one(make_request("a", max_tokens=3, ignore_eos=True), [EOS, EOS, EOS])
    assert request.output_token_ids == [EOS, EOS, EOS] and request.finish_reason == "length"


def test_stop_token_ids_set_the_stop_reason():
    request = run_one(make_request("a", max_tokens=10, stop_token_ids=[42]), [5, 42, 6])
    assert request.output_token_ids == [5, 42]
    assert (request.finish_reason, request.stop_reason) == ("stop", 42)


def test_stop_token_ids_apply_even_with_ignore_eos():
    request = run_one(make_request("a", max_tokens=10, ignore_eos=True, stop_token_ids=[EOS]), [5, EOS])
    assert (request.finish_reason, request.stop_reason) == ("stop", EOS)


def test_min_tokens_defers_eos_and_stop_tokens():
    request = run_one(make_request("a", max_tokens=10, min_tokens=3, stop_token_ids=[42]), [EOS, 42, EOS, 9])
    assert request.output_token_ids == [EOS, 42, EOS]  # the third token may stop
    assert request.finish_reason == "stop"


def test_max_model_len_caps_an_unbounded_request():
    request = run_one(make_request("a", prompt_len=60, max_tokens=None), [5] * 10)
    assert request.num_tokens == 64 and request.finish_reason == "length"


# ----- admission errors -----


def test_queue_bound_raises_queue_full():
    scheduler = make_scheduler(max_waiting=2)
    scheduler.add_request(make_request("a"))
    scheduler.add_request(make_request("b"))
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("c"))
    step(scheduler)  # both admitted: the queue drains
    scheduler.add_request(make_request("c"))


@pytest.mark.parametrize(("prompt_len", "max_tokens"), [(60, 5), (64, None), (65, 1)])
def test_a_request_longer_than_max_model_len_is_rejected(prompt_len, max_tokens):
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("a", prompt_len=prompt_len, max_tokens=max_tokens))
    assert not scheduler.has_unfinished_requests()


def test_duplicate_ids_and_empty_prompts_are_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a"))
    with pytest.raises(ValueError, match="empty prompt"):
        make_request("b", prompt_len=0)


# ----- randomized -----


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_keeps_invariants_and_frees_everything(seed):
    rng = random.Random(seed)
    chunked = rng.random() < 0.7
    max_model_len = rng.choice([16, 32, 48])
    block_size = rng.choice([1, 2, 4, 16])
    max_num_seqs = rng.randint(1, 8)
    budget = rng.randint(max_num_seqs, 40) if chunked else rng.randint(max_model_len, 80)
    min_blocks = -(-max_model_len // block_size)
    config = make_config(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=rng.randint(min_blocks, 3 * min_blocks),
        enable_chunked_prefill=chunked,
    )
    scheduler = RecordingScheduler(config, clock=TickingClock())
    ids: list[str] = []
    sampled_log: dict[str, list[int]] = {}
    finished: dict[str, Request] = {}
    introduced: list[str] = []
    reported: list[str] = []
    pending = 40

    def sample(request_id: str, _position: int) -> int:
        token = rng.choice([EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
        sampled_log[request_id].append(token)
        return token

    for _ in range(5000):
        while pending and rng.random() < 0.4:
            request_id = f"r{pending}"
            prompt_len = rng.randint(1, max_model_len - 1)
            max_tokens = rng.choice([None, rng.randint(1, max_model_len - prompt_len)])
            params = dict(ignore_eos=rng.random() < 0.3, min_tokens=rng.choice([0, 0, 2]) if max_tokens != 1 else 0)
            scheduler.add_request(make_request(request_id, prompt_len, max_tokens, **params))
            ids.append(request_id)
            sampled_log[request_id] = []
            pending -= 1
        if ids and rng.random() < 0.03:
            victim = rng.choice(ids)
            if scheduler.abort_request(victim):
                finished[victim] = scheduler.added[victim]
        output, done = step(scheduler, sample)
        introduced += [n.request_id for n in output.new_requests]
        reported += output.finished_request_ids
        finished.update((r.request_id, r) for r in done)
        check_state(scheduler, ids)
        if not pending and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests(), "workload did not finish"
    assert scheduler.block_manager.num_free_blocks == config.num_kv_blocks
    assert set(finished) == set(ids)
    reported += scheduler.schedule().finished_request_ids
    assert sorted(reported) == sorted(ids)  # every finish reaches the runners, once
    ran = [r for r in ids if finished[r].first_scheduled_time is not None]
    assert sorted(introduced) == sorted(ran)  # introduced once, preemptions notwithstanding
    for request_id, request in finished.items():
        assert request.status.is_finished and request.block_ids == []
        assert request.output_token_ids == sampled_log[request_id]  # preemption lost nothing
        assert request.num_tokens <= max_model_len
        if request.finish_reason == "length":
            max_tokens = request.sampling_params.max_tokens
            assert request.num_output_tokens == max_tokens or request.num_tokens == max_model_len
