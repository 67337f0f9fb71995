"""A lost data-parallel group's requests move to the survivors and continue where they were."""

from __future__ import annotations

import pytest

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig
from moeserve.scheduler.request import RequestStatus

EOS = 2


def request(request_id: str, prompt_len: int, max_tokens: int = 12) -> Request:
    prompt = [10 + (sum(map(ord, request_id)) + i) % 50 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0)


def scheduler(groups: int, policy: str = "fcfs") -> DataParallelScheduler:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_kv_blocks=32, policy=policy
    )
    return DataParallelScheduler(config, groups)


def token_for(request_id: str, position: int) -> int:
    """A deterministic 'model': the token depends only on the sequence and its length, as greedy
    decoding's does, so a recomputed sequence must continue with the same tokens."""
    return 20 + (sum(map(ord, request_id)) * 31 + position) % 70


def step(dp: DataParallelScheduler, sampled_so_far: dict[str, list[int]]) -> list[str]:
    plan = dp.schedule()
    tokens = {}
    for s in plan.scheduled:
        if s.sample:
            tokens[s.request_id] = token_for(s.request_id, s.start_position + len(s.token_ids))
    for rid, token in tokens.items():
        sampled_so_far.setdefault(rid, []).append(token)
    return [r.request_id for r in dp.update(plan, tokens)]


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_a_lost_groups_requests_finish_elsewhere_with_the_tokens_they_would_have_had(policy):
    dp = scheduler(3, policy)
    ids = [f"r{i}" for i in range(9)]
    for i, rid in enumerate(ids):
        dp.add_request(request(rid, 3 + i))
    streamed: dict[str, list[int]] = {}
    for _ in range(4):
        step(dp, streamed)
    lost = {rid for rid in ids if dp.group_of(rid) == 1}
    assert lost
    dp.schedule()  # the step in flight when the rank goes: no update comes for it
    assert dp.heal({1}) == len(lost)

    assert len(dp.groups) == 2 and dp.num_used_blocks == 0  # every running request was preempted
    assert all(dp.group_of(rid) in (0, 1) for rid in ids)
    plan = dp.schedule()
    announced = {new.request_id: new for group in plan.groups for new in group.new_requests}
    assert set(announced) == set(ids)  # the runners start afresh, and learn what was sampled
    assert all(list(announced[rid].output_token_ids) == streamed[rid] for rid in ids)
    tokens = {
        s.request_id: token_for(s.request_id, s.start_position + len(s.token_ids)) for s in plan.scheduled if s.sample
    }
    for rid, token in tokens.items():
        streamed[rid].append(token)
    dp.update(plan, tokens)
    for _ in range(60):
        if not dp.has_unfinished_requests():
            break
        step(dp, streamed)
    assert not dp.has_unfinished_requests() and dp.num_used_blocks == 0
    for rid in ids:  # each stream went on from where it was, and its tokens are the uninterrupted ones
        prompt = request(rid, 3 + ids.index(rid)).prompt_token_ids
        assert streamed[rid] == [token_for(rid, len(prompt) + k) for k in range(12)], rid


def test_a_heal_keeps_the_survivors_requests_in_their_group_and_renumbers_it():
    dp = scheduler(3)
    for i in range(6):
        dp.add_request(request(f"r{i}", 4))
    step(dp, {})
    before = {f"r{i}": dp.group_of(f"r{i}") for i in range(6)}
    dp.heal({0})
    for rid, group in before.items():
        if group == 2:
            assert dp.group_of(rid) == 1
    group_of_moved = {dp.group_of(rid) for rid, group in before.items() if group == 0}
    assert group_of_moved <= {0, 1}
    statuses = {r.status for g in dp.groups for r in g.live_requests()}
    assert statuses == {RequestStatus.PREEMPTED}


def test_healing_every_group_away_is_refused():
    dp = scheduler(2)
    with pytest.raises(ValueError, match="no data-parallel group"):
        dp.heal({0, 1})


def test_new_requests_route_over_the_survivors_with_what_their_models_learnt():
    """The token router keeps one step-time model per surviving group, in the new numbering."""
    dp = scheduler(3)
    models = list(dp.time_router.models)
    dp.heal({1})
    assert dp.time_router.models == [models[0], models[2]]
    dp.add_request(request("late", 4))
    assert dp.group_of("late") in (0, 1)
    dp.heal({0})
    assert dp.time_router is None  # one group left: nothing to choose between
    dp.add_request(request("later", 4))
    assert dp.group_of("later") == 0


def test_returned_groups_join_empty_after_the_others_and_take_new_requests():
    """A restarted rank rejoins as a new last group: running requests stay where their KV is."""
    dp = scheduler(3)
    for i in range(6):
        dp.add_request(request(f"r{i}", 4))
    streamed: dict[str, list[int]] = {}
    step(dp, streamed)
    dp.schedule()
    dp.heal({1})
    step(dp, streamed)
    placed = {rid: dp.group_of(rid) for rid in streamed}
    dp.add_groups(1)
    assert len(dp.groups) == 3 and len(dp.time_router.models) == 3 and dp.num_kv_blocks == 3 * 32
    assert {rid: dp.group_of(rid) for rid in streamed} == placed
    dp.add_request(request("late", 4))
    assert dp.group_of("late") == 2  # the empty group is the least loaded
    for _ in range(40):
        if not dp.has_unfinished_requests():
            break
        step(dp, streamed)
    assert not dp.has_unfinished_requests() and dp.num_used_blocks == 0
    assert all(tokens == [token_for(rid, 4 + k) for k in range(len(tokens))] for rid, tokens in streamed.items())
