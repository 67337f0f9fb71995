"""The async engine client: concurrent streams match offline generation, disconnects free KV
blocks, bad input reaches the caller, and a dead or stopped engine fails streams instead of hanging."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.engine.async_engine import AsyncEngine, EngineDeadError


@pytest.fixture(scope="module")
def llm(make_checkpoint) -> LLM:
    return LLM(str(make_checkpoint("qwen3_moe", 0)), max_model_len=128)


@pytest.fixture
def served(llm: LLM):
    """An AsyncEngine around the shared engine, shut down (and its thread joined) after the test."""
    client = AsyncEngine(llm.engine)
    client.start()
    yield client
    client.shutdown(timeout=10)
    assert not client._thread.is_alive()


def mixed_requests(n: int, seed: int) -> list[tuple[dict, SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(n):
        prompt_len, max_tokens = (
            torch.randint(1, 40, (1,), generator=g).item(),
            torch.randint(1, 20, (1,), generator=g).item(),
        )
        prompt = {"prompt_token_ids": torch.randint(3, 300, (prompt_len,), generator=g).tolist()}
        requests.append((prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    return requests


async def collect(client: AsyncEngine, prompt, params: SamplingParams) -> list:
    return [output async for output in client.generate(prompt, params)]


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrent_streams_match_offline_generation(llm: LLM):
    requests = mixed_requests(16, seed=0)
    alone = [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for prompt, params in requests]
    steps: list[tuple[float, int]] = []
    client = AsyncEngine(llm.engine, on_step=lambda duration, n: steps.append((duration, n)))
    client.start()

    async def run_all() -> list[list]:
        return await asyncio.gather(*(collect(client, prompt, params) for prompt, params in requests))

    try:
        streams = asyncio.run(run_all())
    finally:
        client.shutdown()
    for stream, expected in zip(streams, alone):
        assert [o.finished for o in stream] == [False] * (len(stream) - 1) + [True]
        final = stream[-1].outputs[0]
        assert (final.token_ids, final.text, final.finish_reason) == (expected.token_ids, expected.text, "length")
    assert steps and all(duration > 0 for duration, _ in steps)


def test_consumer_that_stops_early_aborts_its_request(llm: LLM):
    num_steps = 0

    def count_step(duration_s: float, num_outputs: int) -> None:
        nonlocal num_steps
        num_steps += 1

    client = AsyncEngine(llm.engine, on_step=count_step)
    client.start()
    blocks = llm.engine.scheduler

    async def read_two_then_leave() -> None:
        outputs = []
        async for output in client.generate([5] * 20, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)):
            outputs.append(output)
            if len(outputs) == 2:
                break
        await wait_until(lambda: blocks.num_used_blocks == 0 and not llm.engine.has_unfinished_requests())

    try:
        asyncio.run(read_two_then_leave())
    finally:
        client.shutdown()
    assert num_steps < 50  # aborted after a few steps, not run to its 100 tokens


def test_abort_by_id_ends_the_stream(served: AsyncEngine):
    blocks = served.engine.scheduler

    async def main() -> list:
        outputs = []
        async for output in served.generate(
            [7] * 10, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), request_id="r1"
        ):
            outputs.append(output)
            await served.abort("r1")
        await wait_until(lambda: blocks.num_used_blocks == 0)
        return outputs

    outputs = asyncio.run(main())
    assert outputs and not outputs[-1].finished


def test_bad_input_raises_and_engine_keeps_serving(served: AsyncEngine):
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def main() -> list:
        with pytest.raises(ValueError, match="empty"):
            await collect(served, [], params)
        with pytest.raises(ValueError, match="context length"):
            await collect(served, [5] * 200, params)
        return await collect(served, [5, 6, 7], params)

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
    assert served.is_healthy


def test_dead_engine_fails_streams_and_reports_unhealthy(make_checkpoint, monkeypatch: pytest.MonkeyPatch):
    engine = LLM(str(make_checkpoint("qwen3_moe", 0)), max_model_len=128).engine  # its own: this one is left broken

    def broken_step():
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken_step)
    client = AsyncEngine(engine)
    client.start()
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(client, [5, 6], SamplingParams(max_tokens=4)))
    client._thread.join(5)
    assert not client.is_healthy
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(client, [5, 6], SamplingParams(max_tokens=4)))


def test_shutdown_joins_the_thread_and_refuses_new_requests(llm: LLM):
    client = AsyncEngine(llm.engine)
    client.start()
    client.shutdown(timeout=10)
    assert not client._thread.is_alive() and not client.is_healthy
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(client, [5, 6], SamplingParams(max_tokens=4)))
