"""Prefix-aware placement over data-parallel groups: requests sharing a prefix land together
(before and after it is computed) unless that group is much busier; the placements add up to
one computation of the prefix in the prefix cache counts."""

from __future__ import annotations

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig, StepPlan
from moeserve.scheduler.block_hash import hash_block
from moeserve.scheduler.prefix_routing import BUSY_SLACK, PrefixRouter, is_much_busier

EOS = 2
PREFIX = list(range(10, 26))  # four full blocks of 4


def request(request_id: str, tokens: list[int], max_tokens: int = 3) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0)


def scheduler(groups: int, **overrides) -> DataParallelScheduler:
    config = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_kv_blocks=32)
    return DataParallelScheduler(SchedulerConfig(**(config | overrides)), groups)


def step(dp: DataParallelScheduler) -> StepPlan:
    plan = dp.schedule()
    dp.update(plan, {s.request_id: 7 for s in plan.scheduled if s.sample})
    return plan


def test_requests_sharing_a_prefix_land_together_until_that_group_is_much_busier():
    dp = scheduler(4)
    for i in range(6):
        dp.add_request(request(f"shared{i}", PREFIX + [i]))
    dp.add_request(request("other", [99] * 17))
    # Idle groups: a group may carry 2 * 0 + BUSY_SLACK = 8 load (two queued requests) before a
    # sharer goes elsewhere, so three stay together; the next group then collects the next three.
    assert [dp.group_of(f"shared{i}") for i in range(6)] == [0, 0, 0, 1, 1, 1]
    assert dp.group_of("other") == 2  # no prefix anywhere: the least loaded


def test_without_prefix_caching_placement_ignores_prompts():
    dp = scheduler(4, enable_prefix_caching=False)
    for i in range(4):
        dp.add_request(request(f"shared{i}", PREFIX + [i]))
    assert [dp.group_of(f"shared{i}") for i in range(4)] == [0, 1, 2, 3]


def test_a_group_that_cached_a_prefix_gets_its_followers_once_idle_again():
    dp = scheduler(4)
    for i in range(2):
        dp.add_request(request(f"filler{i}", [50 + i] * 9))
    dp.add_request(request("first", PREFIX + [1]))
    assert dp.group_of("first") == 2
    while dp.has_unfinished_requests():
        step(dp)
    dp.add_request(request("follower", PREFIX + [2, 3]))  # every group idle: group 0 is least loaded
    assert dp.group_of("follower") == 2
    plan = step(dp)
    assert (plan.prefix_cache_queries, plan.prefix_cache_hits) == (18, 16)


def test_a_burst_at_four_groups_computes_the_shared_prefix_once():
    """The prefix cache counts say where requests went: three sharers placed together compute
    the prefix once; spread over groups, each group would compute it."""
    dp = scheduler(4)
    for i in range(3):
        dp.add_request(request(f"r{i}", PREFIX + [i, i]))
    queries = hits = 0
    while dp.has_unfinished_requests():
        plan = step(dp)
        queries, hits = queries + plan.prefix_cache_queries, hits + plan.prefix_cache_hits
    assert (queries, hits) == (3 * 18, 2 * 16)


def test_much_busier_means_over_twice_the_least_load_plus_the_slack():
    assert not is_much_busier(BUSY_SLACK, 0) and is_much_busier(BUSY_SLACK + 1, 0)
    assert not is_much_busier(2 * 6 + BUSY_SLACK, 6) and is_much_busier(2 * 6 + BUSY_SLACK + 1, 6)


def test_the_router_forgets_finished_requests_and_prefers_the_longest_match():
    router = PrefixRouter(3)
    one = [hash_block(None, [1, 2])]
    two = [*one, hash_block(one[0], [3, 4])]
    router.add("a", 1, one)
    router.add("b", 2, two)

    def no_cache(group: int) -> int:
        return 0

    assert router.choose(two, no_cache, loads=[0, 0, 4], least=0) == 2  # longest match, not much busier
    assert router.choose(one, no_cache, loads=[0, 1, 1], least=0) == 1  # equal matches: the less loaded
    assert router.choose(two, no_cache, loads=[0, 0, 9], least=0) == 1  # 2 is much busier: the next longest
    router.remove("b")
    router.remove("b")  # unknown now: ignored
    assert router.choose(two, no_cache, loads=[0, 0, 0], least=0) == 1
    assert router.choose(two, lambda group: 2 if group == 2 else 0, loads=[0, 0, 0], least=0) == 2  # its cache
