"""The start-up profile: every step-time model fitted before the first request, nothing else touched."""

from __future__ import annotations

from time import monotonic as now

import pytest

from moeserve.engine.step_profile import PROFILE_SEQS, profile_step_times, profiled_requests
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import DataParallelScheduler, Request, SchedulerConfig, StepPlan, StepShape
from moeserve.scheduler.admission import SLORejectedError
from moeserve.slo import RequestSLO


def true_step_s(shape: StepShape) -> float:
    """A device whose steps cost 4 ms, 40 us a token, 1 ms a sequence and 2 us a KV position read."""
    return 0.004 + 40e-6 * shape.num_tokens + 0.001 * shape.num_seqs + 2e-6 * shape.num_kv_reads


class FakeDevice:
    """Runs plans as a runner would be asked to: one token per sampled sequence, the step timed by
    `true_step_s` (each group's share alike, as the lockstep step is), and records what it ran."""

    def __init__(self) -> None:
        self.plans: list[StepPlan] = []
        self.live: set[str] = set()  # sequences a runner would hold state for

    def __call__(self, plan: StepPlan):
        self.plans.append(plan)
        self.live -= set(plan.finished_request_ids)
        self.live |= {new.request_id for group in plan.groups for new in group.new_requests}
        shapes = [StepShape.of((len(s.token_ids), s.start_position) for s in g.scheduled) for g in plan.groups]
        return {s.request_id: (7,) for s in plan.scheduled if s.sample}, max(map(true_step_s, shapes)), None


def dp_scheduler(groups: int, **overrides) -> DataParallelScheduler:
    config = (
        dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=192, block_size=16, num_kv_blocks=64) | overrides
    )
    return DataParallelScheduler(SchedulerConfig(**config), groups)


@pytest.mark.parametrize("groups", [1, 2])
def test_every_model_predicts_steps_it_never_saw_before_the_first_request(groups: int) -> None:
    scheduler = dp_scheduler(groups, policy="slo", slo_admission="reject")
    assert len(scheduler.step_time_models) == (2 * groups if groups > 1 else 1)  # each group's, and the router's
    assert not any(model.ready for model in scheduler.step_time_models)
    device = FakeDevice()

    profile = profile_step_times(scheduler, device, vocab_size=100)

    assert profile.ready and all(model.ready for model in scheduler.step_time_models)
    assert profile.num_steps == len(device.plans) - 1  # and one last plan with only the finished ids
    unseen = [
        StepShape.of([(1, 300)] * 6),  # six decodes deep into their context
        StepShape.of([(1, 40)] * 3 + [(100, 0)]),  # a prefill beside three decodes
        StepShape.of([(200, 0)]),
    ]
    for model in scheduler.step_time_models:
        for shape in unseen:
            assert model.predict(shape) == pytest.approx(true_step_s(shape), rel=0.05)


def test_every_group_profiles_the_same_steps_and_the_runners_forget_them() -> None:
    device = FakeDevice()
    profile_step_times(dp_scheduler(2, slo_admission="reject"), device, vocab_size=100)

    for plan in device.plans[:-1]:
        first, second = ([(len(s.token_ids), s.start_position) for s in g.scheduled] for g in plan.groups)
        assert first == second and first
    decode_batches = {len(plan.groups[0].scheduled) for plan in device.plans[:-1]}
    assert decode_batches == set(range(1, PROFILE_SEQS + 1))
    last = device.plans[-1]
    assert last.is_empty and last.finished_request_ids and not device.live


def test_the_engines_scheduler_never_sees_the_profiles_requests() -> None:
    """Its queue, blocks, prefix cache and admission tally are as new; a first request is judged
    by a fitted model: refused when it cannot be on time, with no step run yet."""
    scheduler = dp_scheduler(1, slo_admission="reject", num_kv_blocks=64)
    profile_step_times(scheduler, FakeDevice(), vocab_size=100)

    group = scheduler.groups[0]
    assert not scheduler.has_unfinished_requests() and scheduler.num_used_blocks == 0
    assert group.block_manager.num_cached_blocks == 0
    assert (group.admission.predicted_on_time, group.admission.rejected) == (0, 0)
    prompt = list(range(1, 161))  # ten blocks of prefill: ~15 ms on the fake device
    tight, loose = (SamplingParams(max_tokens=4, slo=RequestSLO(ttft_s, 1.0)) for ttft_s in (0.001, 1.0))
    with pytest.raises(SLORejectedError):
        scheduler.add_request(Request("tight", prompt, tight, (), now()))
    scheduler.add_request(Request("loose", prompt, loose, (), now()))
    assert (group.admission.rejected, group.num_waiting) == (1, 1)


def test_requests_too_short_for_a_model_run_again_until_every_model_is_ready() -> None:
    """An 8-token context leaves one request of 7 steps: three rounds make 21, over the 16 a model needs."""
    scheduler = dp_scheduler(1, slo_admission="reject", max_num_seqs=1, max_model_len=8)
    device = FakeDevice()

    profile = profile_step_times(scheduler, device, vocab_size=100)

    assert (profile.num_steps, profile.ready) == (21, True)
    assert len({new.request_id for plan in device.plans for new in plan.groups[0].new_requests}) == 3
    assert not device.live


def profiled(**overrides) -> list[tuple[int, int]]:
    config = dict(max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=4096, block_size=16, num_kv_blocks=512)
    return [(r.prompt_tokens, r.output_tokens) for r in profiled_requests(SchedulerConfig(**config | overrides))]


def test_the_profiled_requests_fit_the_server() -> None:
    """Prompts double up to the longest chunk a step takes, within max_model_len, one per seat,
    and all fit the KV cache at once."""
    assert profiled() == [(32, 20), (64, 18), (128, 16), (256, 14)]
    assert profiled(max_num_batched_tokens=64) == [(8, 20), (16, 18), (32, 16), (64, 14)]
    arrivals = [r.arrives_at_step for r in profiled_requests(SchedulerConfig(max_model_len=64, num_kv_blocks=64))]
    assert arrivals == [0, 1, 2, 3]
    assert profiled(max_num_seqs=2, max_model_len=24, num_kv_blocks=8) == [(2, 20), (4, 18)]
    assert profiled(max_num_seqs=1, max_model_len=8, num_kv_blocks=8) == [(1, 7)]
    # 12 blocks of 16 tokens: 172-token prompts would take 25, so they halve twice (11 blocks).
    assert profiled(max_model_len=192, num_kv_blocks=12) == [(5, 20), (10, 18), (21, 16), (43, 14)]
    # 5 blocks: 1-token prompts still take 7 for four requests, 6 for three; two remain (4 blocks).
    assert profiled(max_model_len=48, num_kv_blocks=5) == [(1, 20), (1, 18)]
