"""The engine core in its own process, from the server's side: outputs match the offline engine,
an abort crosses to the core and frees its KV blocks, and a core that dies fails every stream
with the reason instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from moeserve import LLM, SamplingParams
from moeserve.engine.core_client import EngineCoreClient
from moeserve.engine.cpu_binding import CpuBinding
from moeserve.engine.stats import IterationStats
from moeserve.engine.streams import EngineDeadError
from moeserve.engine_config import EngineConfig

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


class Recorder:
    """A stat logger keeping every `IterationStats` (it is called on the client's output thread)."""

    def __init__(self) -> None:
        self.stats: list[IterationStats] = []
        self.lock = threading.Lock()

    def record(self, stats: IterationStats) -> None:
        with self.lock:
            self.stats.append(stats)

    def last(self) -> IterationStats:
        with self.lock:
            return self.stats[-1]


@pytest.fixture(scope="module")
def folder(make_checkpoint) -> str:
    return str(make_checkpoint("qwen3_moe", 0))


def start_client(folder: str, recorder: Recorder | None = None, on_death=None) -> EngineCoreClient:
    config = EngineConfig(model=folder, max_model_len=128)
    client = EngineCoreClient(config, stat_loggers=[recorder] if recorder else [], on_death=on_death)
    client.start()
    return client


@pytest.fixture(scope="module")
def served(folder: str):
    recorder = Recorder()
    client = start_client(folder, recorder)
    yield client, recorder
    client.shutdown(timeout=20)
    assert client._process.proc.poll() == 0 and not client.is_healthy


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_streams_match_offline_generation_and_stop_strings_end_them(served, folder: str) -> None:
    client, _ = served
    prompts = [[5, 6, 7], [9] * 12, [40, 41]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = LLM(folder, max_model_len=128).generate([{"prompt_token_ids": p} for p in prompts], greedy, False)
    stop = expected[0].outputs[0].text[3:5]  # a piece of the first text, hit mid-stream

    async def main() -> list:
        runs = []
        for p in prompts:
            runs.append([o async for o in client.generate({"prompt_token_ids": p}, greedy)])
        stopped = [o async for o in client.generate([5, 6, 7], replace(greedy, stop=[stop]))]
        return [run[-1] for run in runs] + [stopped[-1]]

    *finals, stopped = asyncio.run(main())
    assert [f.outputs[0].token_ids for f in finals] == [e.outputs[0].token_ids for e in expected]
    assert [f.outputs[0].text for f in finals] == [e.outputs[0].text for e in expected]
    assert stopped.finished and stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    assert stopped.outputs[0].text == expected[0].outputs[0].text[: expected[0].outputs[0].text.index(stop)]


def test_abort_reaches_the_core_and_frees_its_blocks(served) -> None:
    client, recorder = served

    async def read_two_then_leave() -> None:
        outputs = []
        async for output in client.generate([5] * 20, LONG, request_id="leaver"):
            outputs.append(output)
            if len(outputs) == 2:
                break
        assert recorder.last().kv_blocks_used > 0 or recorder.last().num_running > 0
        await wait_until(lambda: recorder.last().kv_blocks_used == 0 and recorder.last().num_running == 0)

    asyncio.run(read_two_then_leave())
    with recorder.lock:
        aborted = [m for s in recorder.stats for m in s.finished if m.finish_reason == "abort"]
        generated = sum(s.num_generation_tokens for s in recorder.stats)
    assert len(aborted) == 1 and aborted[0].num_generation_tokens < 50
    assert generated < 200  # this and the test before it; the aborted request did not run to 100 tokens


def test_bad_input_and_a_full_queue_reach_the_caller(served) -> None:
    client, _ = served

    async def main() -> None:
        with pytest.raises(ValueError, match="empty"):
            await client.submit([], LONG)
        with pytest.raises(ValueError, match="context length"):
            await client.submit([5] * 200, LONG)
        stream = await client.submit([5, 6], LONG, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            await client.submit([5, 6], LONG, request_id="dup")
        await stream.aclose()

    asyncio.run(main())
    assert client.is_healthy


def test_a_dead_core_fails_streams_with_the_reason(folder: str) -> None:
    deaths: list[BaseException] = []
    client = start_client(folder, on_death=deaths.append)

    async def main() -> list:
        outputs = []
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            async for output in client.generate([5] * 10, SamplingParams(max_tokens=120, ignore_eos=True)):
                outputs.append(output)
                if len(outputs) == 1:
                    os.kill(client.pid, signal.SIGKILL)
        return outputs

    outputs = asyncio.run(main())
    assert outputs and not outputs[-1].finished
    client._thread.join(5)
    assert not client.is_healthy and len(deaths) == 1 and "SIGKILL" in str(deaths[0])
    with pytest.raises(EngineDeadError):
        asyncio.run(client.submit([5, 6], LONG))
    client.shutdown(timeout=5)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind apart")
def test_a_bound_core_steps_on_its_cpus_and_moves_frames_on_the_frontends(folder: str) -> None:
    """With a CPU binding, every thread of the core process keeps to the engine's CPUs but zmq's
    (its socket I/O and reaper threads), which run on the frontend's: a frame sent never
    preempts the step."""
    engine_cpu, frontend_cpu = sorted(os.sched_getaffinity(0))[:2]
    config = EngineConfig(model=folder, max_model_len=128)
    client = EngineCoreClient(config, binding=CpuBinding(engine=(engine_cpu,), frontend=(frontend_cpu,)))
    client.start()
    try:
        affinities = {}
        for task in Path(f"/proc/{client.pid}/task").iterdir():
            name = (task / "comm").read_text().strip()
            affinities.setdefault(name, set()).add(frozenset(os.sched_getaffinity(int(task.name))))
    finally:
        client.shutdown(timeout=20)
    zmq_threads = {name for name in affinities if name.startswith("ZMQbg/")}
    assert "ZMQbg/IO/0" in zmq_threads, affinities
    for name, seen in affinities.items():
        assert seen == {frozenset({frontend_cpu if name in zmq_threads else engine_cpu})}, (name, seen)
