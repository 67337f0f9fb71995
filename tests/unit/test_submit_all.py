"""`submit_all`: the prompts of one HTTP request reach the engine together, all or none.

The engine here answers an add only when told to, as the core answers between steps: a request
of n prompts whose submissions waited for each other's answers reached the scheduler over n steps.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from moeserve.api.errors import APIError
from moeserve.api.generation import submit_all
from moeserve.engine.streams import RequestStream, Stream
from moeserve.sampling_params import SamplingParams
from moeserve.scheduler import QueueFullError


class AnswersBetweenSteps:
    """Queues every add; `answer()` accepts them (or refuses those named), as one core step would."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.refuse = refuse
        self.queued: list[tuple[str, asyncio.Future]] = []
        self.aborted: list[str] = []

    async def submit(self, prompt: dict, params: SamplingParams, request_id: str) -> RequestStream:
        answer = asyncio.get_running_loop().create_future()
        self.queued.append((request_id, answer))
        try:
            await answer
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        stream = Stream(asyncio.get_running_loop())
        return RequestStream(request_id, stream, lambda: self.aborted.append(request_id))

    def answer(self) -> None:
        for request_id, answer in self.queued:
            if not answer.done():
                if request_id in self.refuse:
                    answer.set_exception(QueueFullError("the queue is full"))
                else:
                    answer.set_result(None)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _submit(engine: AnswersBetweenSteps, count: int) -> asyncio.Task:
    prompts = [{"prompt_token_ids": [1, 2, i]} for i in range(count)]
    state = SimpleNamespace(metrics=None)
    return asyncio.ensure_future(submit_all(state, engine, prompts, SamplingParams(), "cmpl-x", "prompt"))


def test_every_prompt_is_queued_before_the_first_answer() -> None:
    async def scenario() -> None:
        engine = AnswersBetweenSteps()
        task = _submit(engine, 16)
        await _settle()
        assert [rid for rid, _ in engine.queued] == [f"cmpl-x-{i}" for i in range(16)], "one step admits them all"
        engine.answer()
        streams = await asyncio.wait_for(task, 5)
        assert [s.request_id for s in streams] == [f"cmpl-x-{i}" for i in range(16)]
        assert engine.aborted == []

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_one_refusal_aborts_the_accepted_others() -> None:
    async def scenario() -> None:
        engine = AnswersBetweenSteps(refuse=frozenset({"cmpl-x-2"}))
        task = _submit(engine, 4)
        await _settle()
        engine.answer()
        with pytest.raises(APIError) as raised:
            await task
        assert raised.value.status_code == 429
        assert sorted(engine.aborted) == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-3"]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_cancelled_request_leaves_no_prompt_running() -> None:
    async def scenario() -> None:
        engine = AnswersBetweenSteps()
        task = _submit(engine, 3)
        await _settle()
        engine.queued[0][1].set_result(None)  # the first is accepted, the others still wait
        await _settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _settle()
        assert sorted(engine.aborted) == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]

    asyncio.run(asyncio.wait_for(scenario(), 10))
