"""Requests spread over data-parallel attention groups: balanced, owned for life, bounded together."""

from __future__ import annotations

import pytest

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, QueueFullError, Request, SchedulerConfig, StepShape

EOS = 2


def request(request_id: str, prompt_len: int = 4, max_tokens: int = 3) -> Request:
    return Request(
        request_id, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0
    )


def scheduler(groups: int, **overrides) -> DataParallelScheduler:
    config = (
        dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_kv_blocks=32) | overrides
    )
    return DataParallelScheduler(SchedulerConfig(**config), groups)


def run_to_completion(dp: DataParallelScheduler, token: int = 7) -> list[str]:
    finished = []
    for _ in range(100):
        if not dp.has_unfinished_requests():
            return finished
        plan = dp.schedule()
        finished += [r.request_id for r in dp.update(plan, {s.request_id: token for s in plan.scheduled if s.sample})]
    raise AssertionError("did not finish")


def test_requests_are_balanced_and_every_group_gets_its_own_plan():
    dp = scheduler(4)
    for i in range(10):
        dp.add_request(request(f"r{i}"))
    assert sorted(dp.group_of(f"r{i}") for i in range(10)) == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    plan = dp.schedule()
    assert len(plan.groups) == 4
    for g, group_plan in enumerate(plan.groups):
        assert {s.request_id for s in group_plan.scheduled} == {f"r{i}" for i in range(10) if dp.group_of(f"r{i}") == g}
    assert dp.num_kv_blocks == 4 * 32
    assert dp.num_used_blocks == 10  # one 4-token block per prompt, in its own group's pool
    assert dp.group_blocks == (("full", 10, 4 * 32),)  # /metrics' one group, the four pools together
    dp.update(plan, {s.request_id: 7 for s in plan.scheduled})
    assert sorted(run_to_completion(dp)) == sorted(f"r{i}" for i in range(10))
    assert dp.num_used_blocks == 0 and dp.group_of("r0") is None


def test_a_busy_group_gets_no_new_request():
    dp = scheduler(2)
    dp.add_request(request("long", max_tokens=20))
    dp.update(dp.schedule(), {"long": 7})  # group 0 now runs one request
    dp.add_request(request("a"))
    dp.add_request(request("b"))
    assert (dp.group_of("long"), dp.group_of("a"), dp.group_of("b")) == (0, 1, 0)


def test_max_waiting_bounds_all_groups_together():
    dp = scheduler(3, max_waiting=4)
    for i in range(4):
        dp.add_request(request(f"r{i}"))
    with pytest.raises(QueueFullError):
        dp.add_request(request("one-too-many"))
    assert dp.num_waiting == 4


def test_abort_and_finish_forget_the_owner():
    dp = scheduler(2)
    dp.add_request(request("a"))
    dp.add_request(request("b"))
    assert dp.abort_request("a") and dp.group_of("a") is None
    assert not dp.abort_request("a")
    plan = dp.schedule()
    dp.update(plan, {"b": 7})
    assert dp.finish_request("b", "stop", "\n") and dp.group_of("b") is None
    assert not dp.has_unfinished_requests() and dp.num_used_blocks == 0


def test_a_timed_step_teaches_every_group_that_ran_and_only_those():
    dp = scheduler(2, policy="slo")
    dp.add_request(request("a", max_tokens=5))  # group 0; group 1 stays idle
    probe = StepShape.of([(4, 0)])
    plan = dp.schedule()
    dp.update(plan, {"a": 7}, duration_s=0.01)
    busy, idle = (group.step_time_model for group in dp.groups)
    assert busy.predict(probe) > 0.0 and idle.predict(probe) == 0.0  # 0.0: never observed a step


def test_each_group_plan_introduces_its_requests_and_reports_its_finishes():
    dp = scheduler(2)
    dp.add_request(request("a", max_tokens=1))
    dp.add_request(request("b", max_tokens=1))
    plan = dp.schedule()
    assert [[n.request_id for n in group.new_requests] for group in plan.groups] == [["a"], ["b"]]
    dp.update(plan, {"a": 7, "b": 7})
    assert dp.abort_request("a") is False  # finished by length already
    plan = dp.schedule()
    assert [group.finished_request_ids for group in plan.groups] == [["a"], ["b"]]
    assert plan.is_empty and not plan.is_idle  # nothing to run, but the ranks must hear of it
    assert dp.schedule().is_idle
