"""The engine core's frames: what crosses the process boundary survives it, and a step's outputs
for every sequence travel in one frame (the loop driven in this process over a recording channel)."""

from __future__ import annotations

import os

import pytest

import moeserve.engine.core as engine_core
from moeserve.dispatch.expert_load import RoutedTokens
from moeserve.dispatch.wire import WireVolume
from moeserve.engine.core import CoreRequest, CoreStep, EngineCore, FinishedSequence, SchedulerStats
from moeserve.engine.core_messages import (
    Abort,
    Add,
    CoreInputs,
    CoreOutputs,
    Finish,
    Shutdown,
    decode_inputs,
    decode_outputs,
    encode_inputs,
    encode_outputs,
    refusal,
)
from moeserve.engine.core_process import CoreLoop
from moeserve.engine.engine import ModelFacts
from moeserve.engine_config import EngineConfig
from moeserve.eplb import RebalanceReport
from moeserve.executor import HealReport, RejoinReport
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import QueueFullError
from moeserve.scheduler.block_groups import GroupBlocks
from moeserve.spec_decode.stats import SpecDecodeStats
from moeserve.worker.prompt_logprobs import PromptLogprobs
from moeserve.worker.runner import SampledToken

GROUPS = (GroupBlocks("window", 3, 40), GroupBlocks("compressed_4", 4, 24))  # named tuples, msgpack'd as arrays


def test_inputs_round_trip_in_order() -> None:
    params = SamplingParams(n=2, max_tokens=7, temperature=0.5, seed=3, stop=["x"], logprobs=2, stop_token_ids=[9])
    commands = [
        Add("r", [CoreRequest("r#0", [5, 6], params, 12.5), CoreRequest("r#1", [5, 6], params, 12.5)]),
        Abort(["r#0"]),
        Finish({"r#1": "x"}),
        Add("r", [CoreRequest("r", [7], SamplingParams(), 13.0)]),  # an id reused after its abort
        Shutdown(),
    ]
    assert decode_inputs(encode_inputs(CoreInputs(commands))).commands == commands


def test_outputs_round_trip() -> None:
    wire = WireVolume([[6, 4], [1, 9]], 256, 512)
    routed = RoutedTokens([[1, 2, 3, 4], [0, 0, 5, 5]], [[3, 7], [0, 10]], (1, 3), wire)
    step = CoreStep(
        sampled={
            "a": SampledToken(4),
            "b": SampledToken(5, -0.25, ((5, -0.25), (6, -1.5))),
            "d": SampledToken(9, accepted_draft_ids=(7, 8)),
            "e": SampledToken(3, -0.5, ((3, -0.5),), (1, 2), ((-0.125, ((1, -0.125),)), (-2.0, ((4, -1.0),)))),
        },
        finished=[FinishedSequence("a", "length", None), FinishedSequence("c", "stop", 2)],
        first_scheduled={"b": 100.25},
        time=101.0,
        step_duration_s=0.015,
        num_preemptions=1,
        scheduler=SchedulerStats(2, 1, 7, 64, group_blocks=GROUPS),
        routed_tokens=routed,
        rebalances=[
            RebalanceReport(12, (1.5, 2.0), (1.03, 1.1), 45, 1_100_000, 0.004, 0.028),
            RebalanceReport(24, (1.1, 1.2), (1.01, 1.05), 3, 73_728, 0.002, 0.006),
        ],
        prefix_cache_queries=40,
        prefix_cache_hits=32,
        spec_decode=SpecDecodeStats(2, 5, 3, [2, 1, 0]),
    )
    out = CoreOutputs(
        SchedulerStats(2, 1, 7, 64, group_blocks=GROUPS), ["r1"], [("r2", "QueueFullError", "full")], step
    )
    back = decode_outputs(encode_outputs(out))
    assert back == out
    assert back.gauges.group_blocks[1].group == back.step.scheduler.group_blocks[1].group == "compressed_4"
    assert back.step.routed_tokens.per_rank(1) == routed.per_rank(1) == [0, 10]
    assert back.step.rebalances == step.rebalances  # tuples stay tuples: msgpack sent lists
    assert isinstance(back.step.rebalances[0].imbalance_before, tuple)
    quiet = CoreOutputs(SchedulerStats(0, 0, 0, 0), step=CoreStep({}, [], {}, 1.0, 0.01, 0, SchedulerStats(0, 0, 0, 0)))
    assert decode_outputs(encode_outputs(quiet)).step.rebalances == []
    dead = CoreOutputs(SchedulerStats(0, 0, 0, 0), dead="rank 1 was killed")
    assert decode_outputs(encode_outputs(dead)).dead == "rank 1 was killed"


def test_heal_and_rejoin_reports_round_trip() -> None:
    heal = HealReport((2, 5), "rank 2 was killed by SIGKILL", 6, 1, (2,), 55.5, 0.05, 0.01, 0.2, 3, 8, 6_291_456)
    step = CoreStep({}, [], {}, 1.0, 0.3, 0, SchedulerStats(0, 4, 0, 96), heals=[heal])
    back = decode_outputs(encode_outputs(CoreOutputs(SchedulerStats(0, 4, 0, 96), step=step)))
    assert back.step.heals == [heal]  # the rank tuples stay tuples
    assert isinstance(back.step.heals[0].lost_ranks, tuple)
    rejoin = RejoinReport((2,), 4, 2, 60.0, 3.5, 0.03, 0.02, 0.08, 16, 0, 12_582_912, 0.1, 3.6)
    step = CoreStep({}, [], {}, 1.0, 0.3, 0, SchedulerStats(0, 4, 0, 128), rejoins=[rejoin])
    back = decode_outputs(encode_outputs(CoreOutputs(SchedulerStats(0, 4, 0, 128), step=step)))
    assert back.step.rejoins == [rejoin] and isinstance(back.step.rejoins[0].ranks, tuple)


def test_prompt_logprobs_round_trip() -> None:
    chunks = {
        "a": PromptLogprobs(1, [-0.5, -2.25], [1, 7], [[(3, -0.5), (4, -1.0)], [(9, -0.125), (3, -0.75)]]),
        "b": PromptLogprobs(9, [-1.5], [2], [[]]),
    }
    step = CoreStep({}, [], {}, 1.0, 0.01, 0, SchedulerStats(0, 0, 0, 0), prompt_logprobs=chunks)
    back = decode_outputs(encode_outputs(CoreOutputs(SchedulerStats(0, 0, 0, 0), step=step)))
    assert back.step.prompt_logprobs == chunks  # (id, logprob) pairs stay tuples
    with_params = SamplingParams(prompt_logprobs=4)
    add = CoreInputs([Add("r", [CoreRequest("r", [5, 6], with_params, 1.0)])])
    assert decode_inputs(encode_inputs(add)).commands[0].samples[0].params.prompt_logprobs == 4


def test_refusals_keep_their_type() -> None:
    assert isinstance(refusal("QueueFullError", "full"), QueueFullError)
    assert isinstance(refusal("ValueError", "bad"), ValueError)
    assert str(refusal("KeyError", "odd")) == "odd"


class RecordingChannel:
    """The core's channel with the sockets replaced: one queued input frame per turn, then a
    Shutdown once the core idles; every frame it sends is kept, decoded."""

    def __init__(self, inputs: list[CoreInputs]) -> None:
        self.pending = [encode_inputs(i) for i in inputs]
        self.sent: list[CoreOutputs] = []

    def receive_all(self, timeout_s: float) -> list[bytes]:
        if not self.pending and timeout_s > 0:  # the core waits for work: there is none left
            return [encode_inputs(CoreInputs([Shutdown()]))]
        frames, self.pending = self.pending[:1], self.pending[1:]
        return frames

    def send(self, outputs: CoreOutputs) -> None:
        self.sent.append(decode_outputs(encode_outputs(outputs)))


@pytest.fixture(scope="module")
def core(make_checkpoint) -> EngineCore:
    config = EngineConfig(model=str(make_checkpoint("qwen3_moe", 0)), max_model_len=128, max_waiting=8)
    facts = ModelFacts.read(config)
    return EngineCore(config, facts.model_config, facts.dtype, facts.max_model_len, facts.eos_token_ids)


def test_one_frame_per_step_carries_every_sequence(core: EngineCore) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    adds = [Add(f"r{i}", [CoreRequest(f"r{i}", [5 + i] * (3 + i), params, 0.0)]) for i in range(8)]
    channel = RecordingChannel([CoreInputs(adds)])
    assert CoreLoop(core, channel, parent_pid=os.getppid()).run() == 0
    steps = [frame.step for frame in channel.sent if frame.step is not None]
    assert channel.sent[0].accepted == [f"r{i}" for i in range(8)]
    assert len(steps) == 5  # one prefill of all eight, then four decodes of all eight
    assert all(set(step.sampled) == {f"r{i}" for i in range(8)} for step in steps)
    assert {f.request_id for f in steps[-1].finished} == {f"r{i}" for i in range(8)}
    assert set(steps[0].first_scheduled) == {f"r{i}" for i in range(8)}
    assert channel.sent[-1].stopped and channel.sent[-1].gauges.kv_blocks_used == 0


def test_a_full_queue_refuses_the_whole_request_and_an_abort_frees_its_blocks(core: EngineCore) -> None:
    params = SamplingParams(n=2, max_tokens=50, temperature=0.0, ignore_eos=True)
    samples = [CoreRequest(f"big#{i}", [5] * 20, params, 0.0) for i in range(2)]
    overflow = [Add(f"w{i}", [CoreRequest(f"w{i}", [6], params, 0.0)]) for i in range(6)]  # 8 waiting: full
    too_many = Add("late", [CoreRequest("late#0", [7], params, 0.0), CoreRequest("late#1", [7], params, 0.0)])
    channel = RecordingChannel([CoreInputs([Add("big", samples), *overflow, too_many])])
    loop = CoreLoop(core, channel, parent_pid=os.getppid())
    channel.pending.append(encode_inputs(CoreInputs([Abort(["big#0", "big#1", *(f"w{i}" for i in range(6))])])))
    assert loop.run() == 0
    answer, step, after_abort = channel.sent[:3]
    assert answer.step is None and answer.gauges.num_waiting == 8  # admissions are answered before the step
    assert answer.accepted == ["big", *(f"w{i}" for i in range(6))]
    assert [(key, kind) for key, kind, _ in answer.refused] == [("late", "QueueFullError")]
    assert step.step.scheduler.kv_blocks_used > 0
    assert after_abort.gauges.kv_blocks_used == 0 and after_abort.gauges.num_waiting == 0
    assert not core.has_unfinished_requests()


class ReportingExecutor:
    """An executor that records what the core asks of it; `rebalance_at` steps end in a rebalance."""

    def __init__(self, rebalance_at: set[int]) -> None:
        self.calls: list[str] = []
        self.steps = 0
        self.rebalance_at = rebalance_at

    def ask_routed_tokens(self) -> None:
        self.calls.append("ask")

    def rejoin(self) -> None:
        return None  # no rank comes back here

    def execute(self, plan) -> dict:
        self.steps += 1
        self.calls.append("execute")
        return {}

    def take_rebalances(self) -> list[RebalanceReport]:
        if self.steps in self.rebalance_at:
            return [RebalanceReport(self.steps, (1.5, 1.6), (1.0, 1.0), 4, 4096, 0.001, 0.002)]
        return []

    def take_prompt_logprobs(self) -> dict:
        return {}

    def take_routed_tokens(self) -> RoutedTokens:
        self.calls.append("take")
        return RoutedTokens([[self.steps]], [[self.steps]], (1,))


def test_the_load_is_asked_before_the_step_it_covers_and_taken_at_each_rebalance(core, monkeypatch) -> None:
    """A report covers its own step (asked before it, not after), and a rebalance closes one."""
    executor = ReportingExecutor(rebalance_at={3})
    monkeypatch.setattr(core, "executor", executor)
    monkeypatch.setattr(core, "_routing_asked", float("-inf"))  # never asked (0.0 is recent on a fresh boot)
    monkeypatch.setattr(engine_core, "ROUTING_INTERVAL_S", 3600.0)  # due once: the first step
    steps = [core.step() for _ in range(4)]
    assert executor.calls == ["ask", "execute", "take", "execute", "execute", "take", "execute"]
    assert [s.routed_tokens is not None for s in steps] == [True, False, True, False]
    assert [len(s.rebalances) for s in steps] == [0, 0, 1, 0] and steps[2].rebalances[0].step == 3
