"""The slo policy: the step-time model, TBT-sized prefill chunks, TTFT-deadline ordering, and a
randomized comparison with fcfs that checks the scheduler's invariants under both.

Time is simulated: a `ManualClock` moves only when a test says so, and step durations come from a
synthetic cost, so every run is deterministic and fast.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from helpers.clock import ManualClock
from helpers.scheduler import RecordingScheduler, check_output, make_request, token_for

from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, RequestStatus, SchedulerConfig, SchedulerOutput, StepShape, StepTimeModel
from moeserve.scheduler.policy import SLO_STEP_HEADROOM, SloQueue

# Coefficients of `StepShape.features()`: fixed, per token, per sequence, per KV read, per pair.
TRUE_COEFFICIENTS = (2e-3, 50e-6, 100e-6, 20e-9, 0.5e-9)


def true_cost(shape: StepShape, coefficients: tuple[float, ...] = TRUE_COEFFICIENTS) -> float:
    return sum(c * x for c, x in zip(coefficients, shape.features()))


def token_cost(shape: StepShape) -> float:
    """The synthetic GPU of the chunk-sizing tests: 2 ms per step plus 0.1 ms per token."""
    return 2e-3 + 1e-4 * shape.num_tokens


def random_shape(rng: random.Random) -> StepShape:
    """Up to 32 decodes over contexts up to 4000, and often one prefill chunk."""
    chunks = [(1, rng.randint(1, 4000)) for _ in range(rng.randint(0, 32))]
    if not chunks or rng.random() < 0.6:
        chunks.append((rng.randint(1, 1024), rng.randint(0, 3000)))
    return StepShape.of(chunks)


def shape_of(output: SchedulerOutput) -> StepShape:
    return StepShape.of((len(s.token_ids), s.start_position) for s in output.scheduled)


def make_config(**overrides) -> SchedulerConfig:
    """Prefix caching off, as in test_scheduler.py: readmissions recompute from position 0."""
    fields = dict(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=512,
        block_size=4,
        num_kv_blocks=512,
        enable_prefix_caching=False,
    )
    return SchedulerConfig(**(fields | overrides))


def make_scheduler(clock: ManualClock | None = None, **overrides) -> RecordingScheduler:
    return RecordingScheduler(make_config(**overrides), clock=clock or ManualClock())


def trained(scheduler: RecordingScheduler) -> RecordingScheduler:
    """Teach the scheduler's step-time model `token_cost` on a spread of step shapes."""
    rng = random.Random(4)
    for _ in range(100):
        shape = random_shape(rng)
        scheduler.step_time_model.observe(shape, token_cost(shape))
    return scheduler


Timer = Callable[[SchedulerOutput], float]
"""A step's made-up duration, from its plan."""


def step(scheduler: RecordingScheduler, duration_s: Timer | None = None) -> SchedulerOutput:
    """One engine step with the deterministic fake sampler; `duration_s(plan)` times it, if given."""
    output = scheduler.schedule()
    check_output(scheduler, output)
    scheduler.update(output, fake_samples(output), None if duration_s is None else duration_s(output))
    return output


def fake_samples(output: SchedulerOutput) -> dict[str, int]:
    """The deterministic fake sampler's tokens for a plan."""
    positions = {s.request_id: s.start_position + len(s.token_ids) for s in output.scheduled if s.sample}
    return {request_id: token_for(request_id, position) for request_id, position in positions.items()}


# ----- the step-time model -----


def test_step_shape_counts_tokens_sequences_kv_reads_and_pairs():
    shape = StepShape.of([(1, 9), (4, 0)])  # a decode at position 9, a 4-token prompt
    assert shape == StepShape(num_tokens=5, num_seqs=2, num_kv_reads=10 + 4, num_attention_pairs=10 + (1 + 2 + 3 + 4))
    assert shape.features() == (1.0, 5.0, 2.0, 14.0, 20.0)


def test_model_recovers_linear_coefficients_from_noisy_samples():
    rng = random.Random(0)
    model = StepTimeModel(forgetting=0.999)
    for _ in range(2000):
        shape = random_shape(rng)
        model.observe(shape, true_cost(shape) + rng.gauss(0.0, 2e-4))
    assert model.coefficients == pytest.approx(TRUE_COEFFICIENTS, rel=0.2)
    assert model.coefficients[1] == pytest.approx(TRUE_COEFFICIENTS[1], rel=0.02)  # the best-excited one
    for _ in range(100):
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(true_cost(shape), rel=0.03)


def test_model_forgets_an_old_regime():
    rng = random.Random(1)
    model = StepTimeModel()  # forgetting 0.99: a memory of ~100 steps
    for _ in range(300):
        shape = random_shape(rng)
        model.observe(shape, true_cost(shape))
    slower = tuple(2 * c for c in TRUE_COEFFICIENTS)  # e.g. the GPU throttled
    for _ in range(400):
        shape = random_shape(rng)
        model.observe(shape, true_cost(shape, slower))
    for _ in range(50):
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(true_cost(shape, slower), rel=0.05)


def test_model_is_not_ready_before_min_samples():
    model = StepTimeModel(min_samples=8)
    shape = StepShape.of([(1, 100)])
    assert model.predict(shape) == 0.0 and not model.ready
    for _ in range(7):
        model.observe(shape, 0.01)
    assert not model.ready
    model.observe(shape, 0.01)
    assert model.ready and model.predict(shape) == pytest.approx(0.01)


def test_one_stall_moves_a_ready_model_only_a_little():
    rng = random.Random(2)
    clipped, unclipped = StepTimeModel(), StepTimeModel(outlier_ratio=1e9)
    for _ in range(200):
        shape = random_shape(rng)
        for model in (clipped, unclipped):
            model.observe(shape, true_cost(shape))
    probe = StepShape.of([(1, 500)] * 8)
    for model in (clipped, unclipped):
        model.observe(probe, 5.0)  # a garbage-collection pause or a kernel compiled on first use
    assert clipped.predict(probe) == pytest.approx(true_cost(probe), rel=0.1)
    assert unclipped.predict(probe) > 10 * true_cost(probe)  # what clipping prevents


def test_coefficients_stay_non_negative_where_least_squares_would_go_negative():
    rng = random.Random(3)
    model = StepTimeModel()
    for _ in range(200):
        num_seqs = rng.randint(1, 64)
        model.observe(StepShape.of([(1, 50)] * num_seqs), 5e-3 - 5e-5 * num_seqs)  # cheaper when bigger
    assert all(c >= 0.0 for c in model.coefficients)
    assert min(model.predict(random_shape(rng)) for _ in range(100)) >= 0.0


@pytest.mark.parametrize("duration", [-1e-3, math.nan, math.inf])
def test_model_rejects_impossible_durations(duration):
    with pytest.raises(ValueError, match="duration"):
        StepTimeModel().observe(StepShape.of([(1, 1)]), duration)


# ----- config -----


@pytest.mark.parametrize(
    "overrides",
    [
        dict(policy="edf"),
        dict(slo_ttft_s=0.0),
        dict(slo_tbt_s=-0.01),
        dict(slo_tbt_s=math.nan),
        dict(slo_ttft_s=math.inf),
    ],
)
def test_config_rejects_unknown_policies_and_impossible_targets(overrides):
    with pytest.raises(ValueError, match="policy|slo_"):
        make_config(**overrides)


# ----- chunk sizing -----


def decodes_and_a_long_prompt(scheduler: RecordingScheduler) -> SchedulerOutput:
    """Four streams decoding, then a 400-token prompt arrives: the step that must split it."""
    for request_id in "abcd":
        scheduler.add_request(make_request(request_id, prompt_len=4, max_tokens=50))
    step(scheduler)  # the four prompts
    scheduler.add_request(make_request("long", prompt_len=400, max_tokens=2))
    output = step(scheduler)
    assert [len(s.token_ids) for s in output.scheduled[:4]] == [1, 1, 1, 1]  # every decode still runs
    assert output.scheduled[4].request_id == "long"
    return output


def test_slo_sizes_the_chunk_to_the_tbt_target_while_fcfs_takes_the_budget():
    slo = trained(make_scheduler(policy="slo", slo_tbt_s=0.010))
    output = decodes_and_a_long_prompt(slo)
    shape = shape_of(output)
    chunk = output.scheduled[4]
    one_more = StepShape.of([(1, 4)] * 4).plus_chunk(len(chunk.token_ids) + 1, 0)
    aim = 0.010 * SLO_STEP_HEADROOM
    assert slo.step_time_model.predict(shape) <= aim < slo.step_time_model.predict(one_more)
    assert 54 <= len(chunk.token_ids) <= 56  # 2 ms + 0.1 ms x (4 decodes + 56) = 8 ms = 80% of 10 ms
    assert token_cost(shape) <= aim * (1 + 1e-6)  # the target holds on the synthetic GPU too

    fcfs = make_scheduler(policy="fcfs", slo_tbt_s=0.010)
    assert len(decodes_and_a_long_prompt(fcfs).scheduled[4].token_ids) == 256 - 4


def test_slo_finishes_the_split_prompt_in_target_sized_chunks_and_admits_nothing_beside_it():
    slo = trained(make_scheduler(policy="slo", slo_tbt_s=0.010))
    decodes_and_a_long_prompt(slo)
    slo.add_request(make_request("next", prompt_len=4))
    while slo.added["long"].num_output_tokens == 0:
        output = step(slo)
        assert token_cost(shape_of(output)) <= 0.010 * SLO_STEP_HEADROOM * (1 + 1e-6)
        if output.scheduled[-1].request_id == "long" and not output.scheduled[-1].sample:
            assert slo.added["next"].status is RequestStatus.WAITING  # never two mid-prefill


def test_slo_takes_the_full_budget_when_nobody_is_decoding():
    slo = trained(make_scheduler(policy="slo", slo_tbt_s=0.010))
    slo.add_request(make_request("long", prompt_len=400, max_tokens=2))
    assert len(step(slo).scheduled[0].token_ids) == 256


def test_slo_still_advances_prefill_by_a_block_when_decodes_alone_miss_the_target():
    slo = trained(make_scheduler(policy="slo", slo_tbt_s=0.001))  # below the 2 ms fixed cost
    output = decodes_and_a_long_prompt(slo)
    assert len(output.scheduled[4].token_ids) == slo.config.block_size


def test_untrained_slo_sizes_like_fcfs():
    slo = make_scheduler(policy="slo", slo_tbt_s=0.010)
    assert len(decodes_and_a_long_prompt(slo).scheduled[4].token_ids) == 256 - 4


def test_timed_updates_train_the_model_from_real_steps_and_fcfs_has_none():
    slo = make_scheduler(policy="slo")
    for index in range(40):
        slo.add_request(make_request(f"r{index}", prompt_len=1 + index % 37, max_tokens=3))
        step(slo, lambda output: token_cost(shape_of(output)))
    prompt = StepShape.of([(100, 0)])
    assert slo.step_time_model.ready
    assert slo.step_time_model.predict(prompt) == pytest.approx(token_cost(prompt), rel=0.05)

    fcfs = make_scheduler(policy="fcfs")
    fcfs.add_request(make_request("a"))
    step(fcfs, lambda output: 1.0)
    assert fcfs.step_time_model is None


def test_without_chunked_prefill_slo_only_orders_the_queue():
    slo = make_scheduler(policy="slo", enable_chunked_prefill=False, max_num_batched_tokens=512)
    assert slo.step_time_model is None
    output = decodes_and_a_long_prompt(slo)
    assert len(output.scheduled[4].token_ids) == 400


# ----- ordering -----


def timed_request(request_id: str, arrival_time: float, prompt_len: int = 4, max_tokens: int = 4) -> Request:
    prompt = [100 + i for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), (0,), arrival_time=arrival_time)


def test_queue_serves_streams_then_deadlines_then_late_requests():
    clock = ManualClock(0.0)
    queue = SloQueue(ttft_s=5.0, clock=clock)
    for request_id, arrival in [("b", 2.0), ("c", 3.0), ("a", 1.0)]:  # inserted out of arrival order
        queue.add(timed_request(request_id, arrival))
    fresh_victim = timed_request("v", 2.5)  # preempted before its first token: still waits on TTFT
    streaming = [timed_request("s1", 0.0), timed_request("s2", 0.5)]
    for request in streaming:
        request.output_token_ids.append(7)
    for request in (streaming[1], fresh_victim, streaming[0]):  # victims go newest first
        queue.requeue(request)
    clock.now = 6.5  # past a's deadline (6) only
    queue.refresh()
    order = [queue.pop().request_id for _ in range(len(queue))]
    assert order == ["s1", "s2", "b", "v", "c", "a"]


def test_a_late_request_yields_to_one_that_can_still_meet_its_deadline():
    clock = ManualClock(0.0)
    slo = make_scheduler(clock, policy="slo", slo_ttft_s=5.0, max_num_seqs=1)
    fcfs = make_scheduler(clock, policy="fcfs", slo_ttft_s=5.0, max_num_seqs=1)
    for scheduler in (slo, fcfs):
        scheduler.add_request(timed_request("old", arrival_time=0.0))  # deadline 5
        scheduler.add_request(timed_request("new", arrival_time=4.0))  # deadline 9
    clock.now = 6.0
    assert [s.request_id for s in step(slo).scheduled] == ["new"]
    assert [s.request_id for s in step(fcfs).scheduled] == ["old"]
    while slo.is_live("new"):
        step(slo)
    assert [s.request_id for s in step(slo).scheduled] == ["old"]  # late, but not dropped


def test_on_time_requests_are_admitted_by_deadline_not_by_insertion():
    clock = ManualClock(0.0)
    slo = make_scheduler(clock, policy="slo", max_num_seqs=1)
    slo.add_request(timed_request("second", arrival_time=0.2))
    slo.add_request(timed_request("first", arrival_time=0.1))
    assert [s.request_id for s in step(slo).scheduled] == ["first"]


def test_a_preempted_stream_is_readmitted_before_an_earlier_deadline():
    # 8 blocks of 2 tokens: two 12-token sequences can not both stay resident, so "new" (admitted
    # second) is preempted mid-output while "early", with the earliest deadline, waits for a seat.
    clock = ManualClock(10.0)
    limits = dict(max_model_len=16, block_size=2, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2)
    slo = make_scheduler(clock, policy="slo", **limits)
    slo.add_request(timed_request("old", arrival_time=9.0, max_tokens=8))
    slo.add_request(timed_request("new", arrival_time=9.5, max_tokens=8))
    step(slo)
    slo.add_request(timed_request("early", arrival_time=9.2))
    new = slo.added["new"]
    while not new.num_preemptions:
        step(slo)
    assert new.num_output_tokens > 0 and new.status is RequestStatus.PREEMPTED
    while True:
        admitted = [s.request_id for s in step(slo).scheduled if s.start_position == 0]
        if admitted:
            break
    assert admitted[0] == "new"


# ----- randomized: slo keeps every invariant and changes no request's tokens -----


@dataclass
class Workload:
    """Requests and aborts keyed by step index, so both policies see the same arrivals."""

    config: dict
    arrivals: dict[int, list[tuple[str, int, int | None, dict]]]
    aborts: dict[int, list[str]]
    cost: tuple[float, ...]


def random_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    chunked = rng.random() < 0.8
    max_model_len = rng.choice([16, 32, 48])
    block_size = rng.choice([1, 2, 4])
    max_num_seqs = rng.randint(2, 8)
    min_blocks = -(-max_model_len // block_size)
    config = dict(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max_num_seqs, 40) if chunked else rng.randint(max_model_len, 80),
        max_model_len=max_model_len,
        block_size=block_size,
        num_kv_blocks=rng.randint(min_blocks, 2 * min_blocks),  # tight: preemption is common
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,
        slo_ttft_s=rng.choice([0.005, 0.02, 0.1]),
        slo_tbt_s=rng.choice([0.001, 0.003, 0.006]),
    )
    arrivals: dict[int, list] = {}
    aborts: dict[int, list[str]] = {}
    for index in range(40):
        request_id = f"r{index}"
        prompt_len = rng.randint(1, max_model_len - 1)
        max_tokens = rng.choice([None, rng.randint(1, max_model_len - prompt_len)])
        stop_at = prompt_len + rng.randint(1, max_model_len - prompt_len)
        params = dict(stop_token_ids=[token_for(request_id, stop_at)] if rng.random() < 0.3 else [])
        arrivals.setdefault(rng.randint(0, 120), []).append((request_id, prompt_len, max_tokens, params))
        if rng.random() < 0.15:
            aborts.setdefault(rng.randint(0, 200), []).append(request_id)
    cost = (rng.uniform(5e-4, 2e-3), rng.uniform(2e-5, 2e-4), rng.uniform(0.0, 1e-4), rng.uniform(0.0, 2e-8), 0.0)
    return Workload(config, arrivals, aborts, cost)


@dataclass
class Outcome:
    requests: dict[str, Request]
    aborted: set[str]


class AdmissionOrder:
    """The running requests in admission order, as the plans reveal it: a plan feeding a request
    from position 0 (re)admits it."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def running(self, scheduler: RecordingScheduler) -> list[Request]:
        requests = (scheduler.added[request_id] for request_id in self.order)
        return [r for r in requests if r.status is RequestStatus.RUNNING]

    def record(self, output: SchedulerOutput) -> None:
        for s in output.scheduled:
            if s.start_position == 0:
                if s.request_id in self.order:
                    self.order.remove(s.request_id)
                self.order.append(s.request_id)


@dataclass(frozen=True)
class BeforeStep:
    """What the checks of a step need from before it ran."""

    running_ids: list[str]
    """In admission order."""
    decode_ids: list[str]
    model_ready: bool

    @classmethod
    def of(cls, scheduler: RecordingScheduler, admission: AdmissionOrder) -> BeforeStep:
        running = admission.running(scheduler)
        decodes = [r.request_id for r in running if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens]
        model = scheduler.step_time_model
        return cls([r.request_id for r in running], decodes, model is not None and model.ready)


def check_slo_step(scheduler: RecordingScheduler, output: SchedulerOutput, before: BeforeStep) -> None:
    """Decodes are never skipped, victims are the newest admitted, and a step carrying decodes is
    predicted within the TBT target unless it holds no more prefill than the one-block floor."""
    scheduled = {s.request_id: s for s in output.scheduled}
    victims = output.preempted_request_ids
    assert victims == before.running_ids[::-1][: len(victims)], "preempted a request that was not the newest"
    decodes = before.decode_ids
    for request_id in decodes:
        if request_id not in victims:
            assert len(scheduled[request_id].token_ids) == 1, "a decode was skipped"
    model = scheduler.step_time_model
    if model is not None and before.model_ready and any(r in scheduled for r in decodes):
        num_prefill = output.num_batched_tokens - sum(1 for r in decodes if r in scheduled)
        within_target = model.predict(shape_of(output)) <= scheduler.config.slo_tbt_s * SLO_STEP_HEADROOM
        assert within_target or num_prefill <= scheduler.config.block_size


def check_blocks_and_prefill(scheduler: RecordingScheduler, ids: list[str], admission: AdmissionOrder) -> None:
    """Every block has one owner, queued requests hold nothing, and only the most recently
    admitted running request can be mid-prefill."""
    manager = scheduler.block_manager
    owned: list[int] = []
    num_waiting = 0
    for request_id in ids:
        if not scheduler.is_live(request_id):
            continue
        request = scheduler.added[request_id]
        if request.status is RequestStatus.RUNNING:
            assert len(request.block_ids) * manager.block_size >= request.num_computed_tokens
        else:
            num_waiting += 1
            assert request.block_ids == [] and request.num_computed_tokens == 0
        owned += request.block_ids
    assert len(owned) == len(set(owned)) == manager.num_used_blocks
    running = admission.running(scheduler)
    assert len(running) <= scheduler.config.max_num_seqs
    assert (scheduler.num_running, scheduler.num_waiting) == (len(running), num_waiting)
    prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
    assert prefilling in ([], running[-1:]), "only the most recently admitted request may be mid-prefill"


def run_workload(workload: Workload, policy: str) -> Outcome:
    clock = ManualClock(0.0)
    scheduler = RecordingScheduler(SchedulerConfig(**workload.config, policy=policy), clock=clock)
    rng = random.Random(0)  # measurement noise
    admission = AdmissionOrder()
    ids: list[str] = []
    outcome = Outcome({}, set())
    for index in range(5000):
        for request_id, prompt_len, max_tokens, params in workload.arrivals.get(index, []):
            request = make_request(request_id, prompt_len, max_tokens, **params)
            request.arrival_time = clock.now
            scheduler.add_request(request)
            ids.append(request_id)
            outcome.requests[request_id] = request
        for request_id in workload.aborts.get(index, []):
            if scheduler.abort_request(request_id):
                outcome.aborted.add(request_id)
        had_work = scheduler.has_unfinished_requests()
        before = BeforeStep.of(scheduler, admission)
        output = scheduler.schedule()
        check_output(scheduler, output)
        assert output.is_empty == (not had_work), "a step with runnable requests scheduled nothing"
        check_slo_step(scheduler, output, before)  # judged by the model that sized it, before it learns
        duration = 0.0 if output.is_empty else true_cost(shape_of(output), workload.cost) * rng.uniform(0.9, 1.1)
        scheduler.update(output, fake_samples(output), duration)
        admission.record(output)
        check_blocks_and_prefill(scheduler, ids, admission)
        clock.now += duration
        if index > max(workload.arrivals) and not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests(), "workload did not finish"
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    return outcome


@pytest.mark.parametrize("seed", range(16))
def test_random_workload_under_slo_keeps_invariants_and_every_token(seed):
    workload = random_workload(seed)
    slo = run_workload(workload, "slo")
    fcfs = run_workload(workload, "fcfs")
    completed = set(slo.requests) - slo.aborted - fcfs.aborted
    assert completed, "the workload aborted everything"
    assert all(request.status.is_finished for request in slo.requests.values())
    for request_id in completed:
        assert slo.requests[request_id].finish_reason == fcfs.requests[request_id].finish_reason != "abort"
        assert slo.requests[request_id].output_token_ids == fcfs.requests[request_id].output_token_ids
    for request_id in slo.aborted:  # cut short, but what it produced before is still right
        request = slo.requests[request_id]
        expected = [token_for(request_id, request.num_prompt_tokens + i) for i in range(request.num_output_tokens)]
        assert request.output_token_ids == expected
