"""Token-aware data-parallel routing: groups priced by their own step times, so a straggler gets less."""

from __future__ import annotations

import pytest

from moeserve.engine_config import EngineConfig
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig, StepShape
from moeserve.scheduler.load_routing import TimeRouter
from moeserve.straggler import SlowRank, parse_slow_rank

EOS = 2
SLOW = 3


def request(request_id: str, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(request_id, [10] * prompt_len, SamplingParams(max_tokens=max_tokens), (EOS,), arrival_time=0.0)


def group_time_s(group: int, shape: StepShape) -> float:
    """A lockstep group's own time: 2 ms fixed, 0.1 ms a token; the straggler 0.5 ms a token."""
    return 0.002 + (0.0005 if group == SLOW else 0.0001) * shape.num_tokens


def tokens_per_group(routing: str) -> list[int]:
    """Prompt tokens placed in each of 4 groups by a stream of mixed-length requests, two a step,
    every group timed by `group_time_s`."""
    config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=256,
        block_size=16,
        num_kv_blocks=256,
        enable_prefix_caching=False,
        dp_routing=routing,
    )
    dp = DataParallelScheduler(config, 4)
    placed = [0] * 4
    for i in range(160):
        for j in range(2):
            r = request(f"r{i}-{j}", prompt_len=16 + 48 * ((i + j) % 3))
            dp.add_request(r)
            placed[dp.group_of(r.request_id)] += r.num_prompt_tokens
        plan = dp.schedule()
        own = [
            group_time_s(g, StepShape.of((len(s.token_ids), s.start_position) for s in out.scheduled))
            for g, out in enumerate(plan.groups)
        ]
        dp.update(plan, {s.request_id: 7 for s in plan.scheduled if s.sample}, max(own), own)
    return placed


def test_a_straggling_group_gets_fewer_tokens_by_time_than_by_count():
    by_time, by_count = tokens_per_group("tokens"), tokens_per_group("requests")
    fast_mean = sum(by_time[:SLOW]) / SLOW
    assert by_time[SLOW] < 0.5 * fast_mean  # priced at 5x per token, it is left the small change
    assert by_count[SLOW] > 0.6 * sum(by_count[:SLOW]) / SLOW  # counting requests, it gets near its quarter
    assert sum(by_time) == sum(by_count)


def test_the_router_prices_backlogs_by_each_groups_own_model():
    router = TimeRouter(2, max_num_batched_tokens=128)
    for n in range(1, 33):  # group 1 is 4x slower per token, same fixed cost
        shape = StepShape.of([(n, 0)])
        router.observe(0, shape, 0.001 + 0.0001 * n)
        router.observe(1, shape, 0.001 + 0.0004 * n)
    assert router.ready
    light, heavy = StepShape.of([(8, 0)]), StepShape.of([(64, 0)])
    assert router.choose([heavy, light], 8, lambda g: (g,)) == 1  # 16 slow tokens (6.4 ms) beat 72 fast (7.2 ms)
    assert router.choose([StepShape.of([(16, 0)]), light], 8, lambda g: (g,)) == 0  # 24 fast (2.4 ms) beat them
    # 300 tokens take 3 steps of a 128-token budget: the fixed cost is paid three times.
    assert router.cost(0, StepShape.of([(100, 0), (100, 0), (100, 0)])) == pytest.approx(0.003 + 0.03, rel=0.05)


def test_before_every_model_is_ready_groups_compare_by_tokens():
    router = TimeRouter(2, max_num_batched_tokens=64)
    router.observe(0, StepShape.of([(4, 0)]), 0.5)  # one slow step teaches nothing yet
    assert router.choose([StepShape.of([(9, 0)]), StepShape.of([(10, 0)])], 5, lambda g: (g,)) == 0


def test_slow_rank_flag_parses_and_bad_values_say_so():
    assert parse_slow_rank("3:0.5") == SlowRank(3, 0.5)
    assert SlowRank(1, 2.0).delay_s(100) == pytest.approx(0.2)
    for bad in ("3", "x:1", "3:-1", "-1:2", "3:nan"):
        with pytest.raises(ValueError, match="debug-slow-rank"):
            parse_slow_rank(bad)


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="dp_routing"):
        SchedulerConfig(max_model_len=64, num_kv_blocks=8, dp_routing="random")


def test_the_engine_config_takes_the_routing_and_refuses_a_slow_rank_outside_the_layout():
    config = EngineConfig.from_options(ep=4, dp_routing="requests", debug_slow_rank="3:0.5")
    assert (config.dp_routing, config.debug_slow_rank) == ("requests", SlowRank(3, 0.5))
    with pytest.raises(ValueError, match="names rank 4, but --ep is 4"):
        EngineConfig.from_options(ep=4, debug_slow_rank="4:0.5")
