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


def trained_router(slowdown: float) -> TimeRouter:
    """Two groups with the same fixed cost, group 1 `slowdown` times slower per token."""
    router = TimeRouter(2)
    for n in range(1, 33):
        shape = StepShape.of([(n, 0)])
        router.observe(0, shape, 0.001 + 0.0001 * n)
        router.observe(1, shape, 0.001 + slowdown * 0.0001 * n)
    assert router.ready
    return router


def test_the_router_times_each_group_by_its_own_model():
    router = trained_router(slowdown=4.0)
    light, heavy = StepShape.of([(16, 0)]), StepShape.of([(72, 0)])

    def choose(*backlogs: StepShape) -> int:
        return router.choose(lambda g, model: model.predict(backlogs[g]), lambda g: 0, lambda g: (g,))

    assert choose(heavy, light) == 1  # 16 slow tokens (7.4 ms) beat 72 fast (8.2 ms)
    assert choose(StepShape.of([(24, 0)]), light) == 0  # 24 fast (3.4 ms) beat them


def test_before_every_model_is_ready_groups_compare_by_tokens():
    router = TimeRouter(2)
    router.observe(0, StepShape.of([(4, 0)]), 0.5)  # one slow step teaches nothing yet

    def untimed(group: int, model: object) -> float:
        raise AssertionError("no group is timed before every model is ready")

    assert router.choose(untimed, lambda g: 14 + g, lambda g: (g,)) == 0


def test_a_group_with_a_full_batch_gets_no_request_another_can_start_at_once():
    """Group 0 has few tokens to feed but both its seats are taken by long streams; group 1 has a
    200-token prompt to prefill and a free seat. By tokens group 0 looks idle; by first token
    (100 decode steps for a seat against two prefill steps) group 1 is the place."""
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256, block_size=16, num_kv_blocks=64
    )
    dp = DataParallelScheduler(config, 2)
    dp.time_router = trained_router(slowdown=1.0)
    for index in range(2):  # placed by hand, as routing would not fill one group first
        dp.groups[0].add_request(request(f"stream{index}", prompt_len=8, max_tokens=100))
    dp.groups[0].schedule()
    dp.groups[1].add_request(request("document", prompt_len=200))
    assert dp.groups[0].backlog_tokens() < dp.groups[1].backlog_tokens()
    newcomer = request("newcomer", prompt_len=16)
    dp.add_request(newcomer)
    assert dp.group_of("newcomer") == 1


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
