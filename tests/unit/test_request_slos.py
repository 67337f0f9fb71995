"""Per-request SLOs: each request's own TTFT deadline orders the slo queue, prefill chunks fit the
tightest TBT among the decodes they join, and admission predicts TTFT and keeps its promises.

Time is simulated (`ManualClock`) and step durations come from a synthetic cost, as in
test_scheduler_slo.py, so every run is deterministic and fast.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from helpers.clock import ManualClock
from helpers.scheduler import RecordingScheduler, make_request, token_for

from moeserve import LLM
from moeserve.api.errors import APIError
from moeserve.api.protocol import ChatCompletionRequest, CompletionRequest, parse_request, usage_info
from moeserve.engine.core import CoreRequest, EngineCore, SchedulerStats
from moeserve.engine.core_messages import (
    Add,
    CoreInputs,
    CoreOutputs,
    Shutdown,
    decode_outputs,
    encode_inputs,
    encode_outputs,
    refusal,
)
from moeserve.engine.core_process import CoreLoop
from moeserve.engine.engine import ModelFacts
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.stats import RequestMetrics
from moeserve.engine_config import EngineConfig, SLOConfig
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import Request, RequestStatus, SchedulerConfig, SchedulerOutput, SLORejectedError, StepShape
from moeserve.scheduler.first_token import Capacity, Work, project_first_token
from moeserve.scheduler.policy import SLO_STEP_HEADROOM, ChunkSizer, FcfsQueue, SloQueue
from moeserve.slo import RequestSLO, SLOCatalog, SLOClass, parse_slo_class


def token_cost(shape: StepShape) -> float:
    """The synthetic GPU: 2 ms per step plus 0.1 ms per token."""
    return 2e-3 + 1e-4 * shape.num_tokens


def slo_request(request_id: str, arrival: float, ttft_s: float, tbt_s: float = 0.025, **kwargs) -> Request:
    request = make_request(request_id, slo=RequestSLO(ttft_s, tbt_s), **kwargs)
    request.arrival_time = arrival
    return request


def make_scheduler(clock: ManualClock, **overrides) -> RecordingScheduler:
    fields = dict(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=512,
        block_size=4,
        num_kv_blocks=1024,
        enable_prefix_caching=False,
        policy="slo",
    )
    return RecordingScheduler(SchedulerConfig(**(fields | overrides)), clock=clock)


def trained(scheduler: RecordingScheduler) -> RecordingScheduler:
    """Teach the step-time model `token_cost` on a spread of step shapes."""
    rng = random.Random(4)
    for _ in range(100):
        shape = StepShape.of([(1, rng.randint(1, 400)) for _ in range(rng.randint(0, 8))] + [(rng.randint(1, 256), 0)])
        scheduler.step_time_model.observe(shape, token_cost(shape))
    return scheduler


def step(scheduler: RecordingScheduler, clock: ManualClock) -> SchedulerOutput:
    """One engine step timed by `token_cost`; the clock moves by its duration."""
    output = scheduler.schedule()
    shape = StepShape.of((len(s.token_ids), s.start_position) for s in output.scheduled)
    duration = token_cost(shape)
    clock.now += duration
    sampled = {s.request_id: token_for(s.request_id, s.start_position + len(s.token_ids)) for s in output.scheduled}
    scheduler.update(output, {rid: t for rid, t in sampled.items()}, duration)
    return output


# ---- ordering -----------------------------------------------------------------------------


def test_the_slo_queue_orders_by_each_requests_own_ttft_deadline() -> None:
    clock = ManualClock()
    queue = SloQueue(ttft_s=5.0, clock=clock)
    default = make_request("default")  # arrival 0, the server's 5 s: due at 5
    tight = slo_request("tight", arrival=1.0, ttft_s=1.0)  # due at 2
    loose = slo_request("loose", arrival=0.5, ttft_s=30.0)  # due at 30.5
    for request in (default, loose, tight):
        queue.add(request)
    assert [queue.pop().request_id for _ in range(3)] == ["tight", "default", "loose"]

    for request in (default, loose, tight):
        queue.add(request)
    newcomer = slo_request("new", arrival=1.0, ttft_s=3.0)  # due at 4: only "tight" goes first
    assert [r.request_id for r in queue.ahead_of(newcomer)] == ["tight"]
    clock.now = 10.0  # past due: every on-time request and the late ones due earlier go first
    queue.refresh()
    assert [r.request_id for r in queue.ahead_of(newcomer)] == ["loose", "tight"]


def test_a_lower_priority_goes_first_in_either_queue_and_late_requests_still_leave_the_on_time_lane() -> None:
    fcfs = FcfsQueue()
    for request in (
        make_request("a"),
        make_request("b", priority=1),
        make_request("c"),
        make_request("d", priority=-1),
    ):
        fcfs.add(request)
    assert [r.request_id for r in fcfs.ahead_of(make_request("new"))] == ["d", "a", "c"]
    assert [fcfs.pop().request_id for _ in range(4)] == ["d", "a", "c", "b"]

    clock = ManualClock()
    slo = SloQueue(ttft_s=5.0, clock=clock)
    urgent_late = slo_request("urgent", arrival=0.0, ttft_s=1.0, priority=1)  # due at 1, but priority 1
    fresh = slo_request("fresh", arrival=0.0, ttft_s=4.0, priority=1)
    for request in (slo_request("later", arrival=0.0, ttft_s=3.0), fresh, urgent_late):
        slo.add(request)
    probe = slo_request("probe", arrival=0.0, ttft_s=4.0, priority=1)  # would queue after its twin "fresh"
    assert [r.request_id for r in slo.ahead_of(probe)] == ["later", "urgent", "fresh"]
    clock.now = 2.0  # "urgent" is past due behind "later", which is not: it still moves to the late lane
    slo.refresh()
    assert [slo.pop().request_id for _ in range(3)] == ["later", "fresh", "urgent"]
    body = parse_request(CompletionRequest, {"prompt": "hi", "priority": -3})
    assert body.to_sampling_params(None).priority == -3


# ---- chunk sizing ---------------------------------------------------------------------------


def chunk_beside_decodes(tbt_targets: list[float]) -> int:
    """The prefill chunk a long prompt gets in a step with one decode per TBT target."""
    clock = ManualClock()
    scheduler = trained(make_scheduler(clock))
    for index, tbt_s in enumerate(tbt_targets):
        scheduler.add_request(slo_request(f"d{index}", 0.0, ttft_s=5.0, tbt_s=tbt_s, max_tokens=50))
    step(scheduler, clock)  # their prompts
    step(scheduler, clock)  # they decode
    scheduler.add_request(make_request("long", prompt_len=400, max_tokens=4))
    output = step(scheduler, clock)
    (chunk,) = [s for s in output.scheduled if s.request_id == "long"]
    return len(chunk.token_ids)


def test_prefill_chunks_fit_the_tightest_tbt_among_the_decodes() -> None:
    # 2 ms + 0.1 ms per token within TBT * headroom, two tokens of which are the decodes.
    def expected(tbt_s: float) -> int:
        return int((tbt_s * SLO_STEP_HEADROOM - 2e-3) / 1e-4) - 2

    loose = chunk_beside_decodes([0.025, 0.025])
    tight = chunk_beside_decodes([0.025, 0.010])
    assert loose == pytest.approx(expected(0.025), abs=2)
    assert tight == pytest.approx(expected(0.010), abs=2)
    assert tight < loose / 2


# ---- admission -----------------------------------------------------------------------------


CAPACITY = Capacity(max_num_seqs=8, num_kv_blocks=1024, max_num_batched_tokens=256)


def test_with_seats_and_blocks_to_spare_the_wait_is_prefill_steps_times_the_predicted_step() -> None:
    model = trained(make_scheduler(ManualClock())).step_time_model
    queued = [Work(400, 0, 4, 4), Work(500, 0, 4, 4)]
    prediction = project_first_token(model, None, CAPACITY, [], queued, Work(100, 0, 1, 25), 0.025)
    step_s = token_cost(StepShape.of([(256, 0)])) / SLO_STEP_HEADROOM
    assert prediction.wait_s == pytest.approx(4 * step_s, rel=0.03)  # ceil(1000 / 256) full steps
    assert prediction.bottleneck == "prefill"
    alone = project_first_token(model, None, CAPACITY, [], [], Work(100, 0, 1, 25), 0.025)
    assert alone.wait_s == pytest.approx(token_cost(StepShape.of([(100, 0)])) / SLO_STEP_HEADROOM, rel=0.03)

    decodes = [Work(0, 100, 50, 40)] * 4
    sized = project_first_token(model, ChunkSizer(model, 4), CAPACITY, decodes, [], Work(1000, 0, 1, 250), 0.010)
    per_step = int((0.010 * SLO_STEP_HEADROOM - 2e-3) / 1e-4) - 4  # what the TBT target lets in beside 4 decodes
    assert sized.wait_s == pytest.approx(-(-1000 // per_step) * 0.010, rel=0.05)


def test_a_full_batch_makes_a_newcomer_wait_for_the_first_seat_to_free() -> None:
    model = trained(make_scheduler(ManualClock())).step_time_model
    seats = Capacity(max_num_seqs=4, num_kv_blocks=1024, max_num_batched_tokens=256)
    running = [Work(0, 40, outputs, 20) for outputs in (30, 20, 25, 40)]  # decodes with 20-40 tokens to go
    prediction = project_first_token(model, None, seats, running, [], Work(16, 0, 1, 4), 0.025)
    four_decodes = token_cost(StepShape.of([(1, 60)] * 4)) / SLO_STEP_HEADROOM
    assert prediction.wait_s > 20 * four_decodes  # the shortest stream's 20 steps, then its prompt
    assert prediction.wait_s == pytest.approx(21 * four_decodes, rel=0.05)
    assert prediction.bottleneck == "a seat"
    behind = project_first_token(model, None, seats, running, [Work(16, 0, 20, 9)], Work(16, 0, 1, 4), 0.025)
    assert behind.wait_s == pytest.approx(26 * four_decodes, rel=0.05)  # the seat freed at 20 went ahead: 25


def test_speculative_decodes_cost_their_drafts_in_the_projection() -> None:
    """Decodes that may carry 3 drafts feed 4 tokens a step and (assumed rejected) gain one."""
    model = trained(make_scheduler(ManualClock())).step_time_model
    seats = Capacity(max_num_seqs=4, num_kv_blocks=1024, max_num_batched_tokens=256, decode_tokens=4)
    running = [Work(0, 40, outputs, 20) for outputs in (30, 20, 25, 40)]
    prediction = project_first_token(model, None, seats, running, [], Work(16, 0, 1, 4), 0.025)
    four_speculating = token_cost(StepShape.of([(4, 60)] * 4)) / SLO_STEP_HEADROOM
    assert prediction.wait_s == pytest.approx(21 * four_speculating, rel=0.05)
    assert prediction.bottleneck == "a seat"


def test_a_full_cache_makes_a_newcomer_wait_for_blocks() -> None:
    model = trained(make_scheduler(ManualClock())).step_time_model
    blocks = Capacity(max_num_seqs=64, num_kv_blocks=100, max_num_batched_tokens=256)
    running = [Work(0, 40, 10, 30), Work(0, 40, 30, 30), Work(0, 40, 50, 30)]  # 90 of 100 blocks at full length
    prediction = project_first_token(model, None, blocks, running, [], Work(40, 0, 1, 10), 0.025)
    assert prediction.wait_s < 2 * token_cost(StepShape.of([(40, 0)] + [(1, 40)] * 3))  # its 10 blocks are free
    ahead = [Work(40, 0, 8, 20)]  # 20 more blocks: only after the first stream is done
    waits = project_first_token(model, None, blocks, running, ahead, Work(40, 0, 1, 10), 0.025)
    assert waits.bottleneck == "KV blocks"
    assert waits.wait_s > 10 * token_cost(StepShape.of([(1, 40)] * 3)) / SLO_STEP_HEADROOM


def test_the_projection_keeps_the_scheduler_s_promise_when_seats_are_the_limit() -> None:
    """The real scheduler, 4 seats of 20-token streams and a queue: each newcomer's predicted
    TTFT is never early, and within a step or two of the truth."""
    clock = ManualClock()
    scheduler = trained(make_scheduler(clock, policy="fcfs", slo_admission="degrade", max_num_seqs=4))
    for index in range(4):
        scheduler.add_request(slo_request(f"s{index}", 0.0, ttft_s=10.0, prompt_len=16, max_tokens=20 + 5 * index))
    step(scheduler, clock)
    newcomers = [slo_request(f"n{index}", clock.now, ttft_s=10.0, prompt_len=16, max_tokens=8) for index in range(3)]
    for request in newcomers:
        scheduler.add_request(request)
    predicted = {r.request_id: r.predicted_ttft_s for r in newcomers}
    first_tokens = {}
    while scheduler.has_unfinished_requests():
        output = step(scheduler, clock)
        for s in output.scheduled:
            if s.sample and s.request_id in predicted and s.request_id not in first_tokens:
                first_tokens[s.request_id] = clock.now - newcomers[0].arrival_time
    assert len(first_tokens) == 3
    for request_id, ttft_s in first_tokens.items():
        assert ttft_s <= predicted[request_id] <= ttft_s / SLO_STEP_HEADROOM + 0.01, (request_id, ttft_s, predicted)


def queue_ahead(mode: str) -> tuple[RecordingScheduler, ManualClock]:
    """A trained fcfs scheduler (a newcomer queues behind everyone) with 2,000 tokens of prompts
    queued (about 0.3 s of prefill)."""
    clock = ManualClock()
    scheduler = trained(make_scheduler(clock, policy="fcfs", slo_admission=mode))
    for index in range(5):
        scheduler.add_request(slo_request(f"q{index}", 0.0, ttft_s=10.0, prompt_len=400, max_tokens=4))
    return scheduler, clock


def test_reject_refuses_a_request_predicted_to_miss_and_admits_one_that_can_wait() -> None:
    scheduler, _ = queue_ahead("reject")
    with pytest.raises(SLORejectedError, match=r"exceeds the request's target of 100 ms") as refused:
        scheduler.add_request(slo_request("tight", 0.0, ttft_s=0.1, prompt_len=400))
    assert refused.value.retry_after_s >= 1
    assert "tight" not in scheduler.added and scheduler.admission.rejected == 1
    loose = slo_request("loose", 0.0, ttft_s=10.0, prompt_len=400)
    scheduler.add_request(loose)
    assert 0.1 < loose.predicted_ttft_s < 10.0 and not loose.best_effort


def test_degrade_admits_as_best_effort_and_off_or_an_untrained_model_admits() -> None:
    scheduler, _ = queue_ahead("degrade")
    tight = slo_request("tight", 0.0, ttft_s=0.1, prompt_len=400)
    scheduler.add_request(tight)
    assert tight.best_effort and tight.predicted_ttft_s > 0.1 and scheduler.admission.best_effort == 1

    scheduler = trained(make_scheduler(ManualClock(), slo_admission="off"))
    for index in range(5):
        scheduler.add_request(slo_request(f"q{index}", 0.0, ttft_s=0.001, prompt_len=400))
    assert scheduler.num_waiting == 5 and scheduler.admission.rejected == 0
    assert all(r.predicted_ttft_s is None and not r.best_effort for r in scheduler.added.values())
    untrained = make_scheduler(ManualClock(), slo_admission="reject")
    for index in range(5):
        untrained.add_request(slo_request(f"q{index}", 0.0, ttft_s=0.001, prompt_len=400))
    assert untrained.num_waiting == 5  # no prediction yet: nobody is refused on a guess


@pytest.mark.parametrize("policy", ["slo", "fcfs"])
def test_requests_predicted_to_meet_their_ttft_mostly_do(policy: str) -> None:
    RATE = 100.0  # requests/s of ~110 prompt tokens: 11,000 tokens/s, ~8,600 fit 128-token steps
    """A mixed load past capacity: tight (0.15 s) and loose (3 s) requests arrive faster than
    prefill can serve them. Admission rejects some; of those it admitted on a prediction of
    making it, >= 95% got their first token within their target."""
    rng = random.Random(7)
    clock = ManualClock()
    scheduler = trained(make_scheduler(clock, policy=policy, slo_admission="reject", max_num_batched_tokens=128))
    next_arrival, index = 0.0, 0
    while clock.now < 6.0:
        while next_arrival <= clock.now:
            tight = rng.random() < 0.5
            request = slo_request(
                f"r{index}", next_arrival, ttft_s=0.15 if tight else 3.0, prompt_len=rng.randint(20, 200), max_tokens=8
            )
            index += 1
            next_arrival += rng.expovariate(RATE)
            try:
                scheduler.add_request(request)
            except SLORejectedError:
                pass
        if scheduler.has_unfinished_requests():
            step(scheduler, clock)
        else:
            clock.now = next_arrival
    tally = scheduler.admission
    assert tally.rejected > 10, tally  # the load did press: admission had to say no
    assert tally.predicted_on_time > 50, tally
    assert tally.on_time / tally.predicted_on_time >= 0.95, tally


# ---- the body field and classes -----------------------------------------------------------------


CATALOG = SLOCatalog(RequestSLO(5.0, 0.025, "default"), (parse_slo_class("chat=ttft:500,tbt:50"),))


def slo_of(body: dict, request_class: type = CompletionRequest) -> RequestSLO:
    request = parse_request(request_class, {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **body})
    return request.slo.resolve(CATALOG)


def test_the_slo_field_resolves_to_targets_labelled_by_class() -> None:
    assert slo_of({"slo": {"class": "chat"}}) == RequestSLO(0.5, 0.05, "chat")
    assert slo_of({"slo": {"ttft_ms": 500, "tbt_ms": 50}}, ChatCompletionRequest) == RequestSLO(0.5, 0.05, "chat")
    assert slo_of({"slo": {"tbt_ms": 25.0}}) == RequestSLO(5.0, 0.025, "default")
    assert slo_of({"slo": {"ttft_ms": 800}}) == RequestSLO(0.8, 0.025, "custom")  # no class: bounded labels


@pytest.mark.parametrize(
    "slo, says",
    [
        ({"ttft_ms": 0}, "greater than 0"),
        ({"tbt_ms": -5}, "greater than 0"),
        ({"ttft_ms": "500"}, "valid number"),
        ({"ttfts_ms": 5}, "Extra inputs"),
        ({"class": "chat", "ttft_ms": 5}, "not both"),
        ({"class": "batch"}, "unknown SLO class 'batch'"),
        (7, "valid dictionary"),
    ],
)
def test_a_bad_slo_field_is_a_400_naming_it(slo: object, says: str) -> None:
    with pytest.raises(APIError, match=says) as error:
        slo_of({"slo": slo})
    assert error.value.status_code == 400 and error.value.body()["error"]["param"] == "slo"


def test_slo_classes_parse_and_refuse_bad_definitions() -> None:
    assert parse_slo_class("batch=ttft:20000,tbt:200") == SLOClass("batch", 20.0, 0.2)
    for bad in ("chat", "chat=ttft:5", "chat=ttft:x,tbt:5", "chat=ttft:-1,tbt:5", "custom=ttft:1,tbt:1"):
        with pytest.raises(ValueError):
            parse_slo_class(bad)
    with pytest.raises(ValueError, match="unique"):
        SLOCatalog(RequestSLO(5.0, 0.025, "default"), (SLOClass("a", 1, 1), SLOClass("a", 2, 2)))


# ---- across the engine core's process boundary, and into usage ----------------------------------


class RecordingChannel:
    """The core's channel without sockets: the given input frames, then a Shutdown once the core
    idles; every frame the core sends is kept, decoded."""

    def __init__(self, inputs: list[CoreInputs]) -> None:
        self.pending = [encode_inputs(i) for i in inputs]
        self.sent: list[CoreOutputs] = []

    def receive_all(self, timeout_s: float) -> list[bytes]:
        if not self.pending and timeout_s > 0:
            return [encode_inputs(CoreInputs([Shutdown()]))]
        frames, self.pending = self.pending[:1], self.pending[1:]
        return frames

    def send(self, outputs: CoreOutputs) -> None:
        self.sent.append(decode_outputs(encode_outputs(outputs)))


def test_the_core_answers_a_best_effort_admission_with_its_prediction(make_checkpoint) -> None:
    slo = SLOConfig(admission="degrade")
    # Every step padded to 0.2 s, which the start-up profile has the model believe from the start.
    folder = str(make_checkpoint("qwen3_moe", 0))
    config = EngineConfig(model=folder, max_model_len=128, slo=slo, min_step_time_s=0.2)
    facts = ModelFacts.read(config)
    core = EngineCore(config, facts.model_config, facts.dtype, facts.max_model_len, facts.eos_token_ids)
    now = time.monotonic()

    def add(key: str, ttft_s: float) -> Add:
        params = SamplingParams(max_tokens=2, slo=RequestSLO(ttft_s, 0.05, key))
        return Add(key, [CoreRequest(key, [5] * 4, params, now)])

    channel = RecordingChannel([CoreInputs([add("tight", 0.1), add("loose", 10.0)])])
    assert CoreLoop(core, channel, parent_pid=os.getppid()).run() == 0
    answer = channel.sent[0]
    assert answer.accepted == ["tight", "loose"]
    assert set(answer.best_effort) == {"tight"} and answer.best_effort["tight"] >= 0.2


def test_a_rejection_keeps_its_retry_after_across_the_frame() -> None:
    gauges = SchedulerStats(0, 3, 0, 10)
    frame = CoreOutputs(gauges, refused=[("r", "SLORejectedError", "too late")], retry_after_s={"r": 3})
    ((key, kind, message),) = (decoded := decode_outputs(encode_outputs(frame))).refused
    error = refusal(kind, message, decoded.retry_after_s.get(key))
    assert isinstance(error, SLORejectedError) and error.retry_after_s == 3 and str(error) == "too late"


def test_usage_says_best_effort_only_when_admission_did() -> None:
    def finished(best_effort_ttft_s: float | None) -> RequestOutput:
        metrics = RequestMetrics("length", 4, 2, 0.0, 0.1, 0.2, None, True, True, "chat", best_effort_ttft_s)
        return RequestOutput("r", None, [1, 2, 3, 4], [], finished=True, metrics=metrics)

    promised = usage_info([finished(None)]).model_dump()
    assert "slo" not in promised and promised["total_tokens"] == 4
    degraded = usage_info([finished(None), finished(1.25)]).model_dump()
    assert degraded["slo"] == {"admitted": "best_effort", "predicted_ttft_ms": 1250.0}


def test_offline_engine_marks_a_best_effort_request_in_its_final_metrics(make_checkpoint) -> None:
    # Every step padded to 0.2 s, which the start-up profile has the model believe from the start.
    folder = str(make_checkpoint("qwen3_moe", 0))
    with LLM(folder, max_model_len=128, slo_admission="degrade", min_step_time_ms=200) as llm:
        tight = SamplingParams(max_tokens=2, slo=RequestSLO(0.1, 0.05, "chat"))
        loose = SamplingParams(max_tokens=2, slo=RequestSLO(10.0, 0.05, "batch"))
        outputs = [llm.generate([{"prompt_token_ids": [5] * 4}], params)[0] for params in (tight, loose)]
    tight_metrics, loose_metrics = (out.metrics for out in outputs)
    assert tight_metrics.best_effort_ttft_s >= 0.2 and tight_metrics.slo_class == "chat"
    assert loose_metrics.best_effort_ttft_s is None and loose_metrics.slo_class == "batch"


# ---- preempting a loose stream for a tight request ------------------------------------------------


def test_a_loose_stream_yields_its_seat_to_a_tight_request_at_risk() -> None:
    """Two seats held by loose streams (TTFT 20 s, TBT 1 s); a chat request (TTFT 1 s, TBT 50 ms)
    waits. Before it has used half its target nothing happens; then the loosest stream (by TBT,
    then the newest) is preempted, the chat request is admitted next step, and the victim waits
    behind it by its own deadline."""
    clock = ManualClock()
    scheduler = make_scheduler(clock, max_num_seqs=2)
    scheduler.add_request(slo_request("batch-a", 0.0, ttft_s=20.0, tbt_s=1.0, max_tokens=50))
    scheduler.add_request(slo_request("batch-b", 0.0, ttft_s=20.0, tbt_s=1.0, max_tokens=50))
    step(scheduler, clock)
    clock.now = 1.0
    scheduler.add_request(slo_request("chat", 1.0, ttft_s=1.0, tbt_s=0.05, max_tokens=4))
    clock.now = 1.4  # 0.4 s of its 1 s waited: not yet at risk
    assert step(scheduler, clock).preempted_request_ids == []
    clock.now = 1.6
    output = step(scheduler, clock)
    assert output.preempted_request_ids == ["batch-b"] and {s.request_id for s in output.scheduled} == {"batch-a"}
    output = step(scheduler, clock)
    assert {s.request_id for s in output.scheduled} == {"batch-a", "chat"}
    victim = scheduler.added["batch-b"]
    assert scheduler.num_waiting == 1 and victim.status is RequestStatus.PREEMPTED and victim.num_preemptions == 1


def test_no_stream_yields_to_a_request_whose_targets_are_not_tighter_in_both() -> None:
    clock = ManualClock()
    scheduler = make_scheduler(clock, max_num_seqs=1)
    scheduler.add_request(slo_request("stream", 0.0, ttft_s=20.0, tbt_s=0.05, max_tokens=50))
    step(scheduler, clock)
    scheduler.add_request(slo_request("same-tbt", 0.0, ttft_s=1.0, tbt_s=0.05, max_tokens=4))
    clock.now = 5.0  # long past half its TTFT target, but the stream's TBT is as tight as its own
    assert all(not step(scheduler, clock).preempted_request_ids for _ in range(5))
