"""The server through the official `openai` client: same tokens as `LLM.generate`, under
concurrency, disconnects and preemption, with exact metrics.

Every test runs against a single-process server and against `--ep 4` (four rank processes,
four data-parallel attention groups), and compares with the single-process `LLM`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import MAX_MODEL_LEN, ServerProcess

from moeserve import LLM, SamplingParams

PROMPTS = [
    "Hello there",
    "The quick brown fox jumps over",
    "a",
    "Mixture of experts models route every token to a few experts, so",
]


def client(server: ServerProcess, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60, **kwargs)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


LAYOUTS = {
    "ep1": (),
    "ep4": ("--ep", "4"),
}
KV_MEMORY = ("--kv-cache-memory", "64MiB")  # per rank; four ranks need not hold 512 MiB each
# (blocks per data-parallel group, groups): ep4 spreads the requests over four pools
SMALL_POOL = {"ep1": (40, 1), "ep4": (30, 4)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(start_server, layout: str):
    server = start_server(*LAYOUTS[layout], *KV_MEMORY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(server_checkpoint: Path) -> LLM:
    return LLM(str(server_checkpoint), max_model_len=MAX_MODEL_LEN)


def greedy(reference: LLM, prompt, max_tokens: int, **params):
    """The offline engine's greedy sample for `prompt` (text, token ids or a chat conversation)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return reference.chat(prompt, sampling, use_tqdm=False)[0].outputs[0]
    return reference.generate([prompt], sampling, use_tqdm=False)[0].outputs[0]


def wait_idle(server: ServerProcess, timeout: float = 15.0) -> dict[str, float]:
    """/metrics once no request runs or waits; asserts every KV block came back."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = metrics["moeserve:num_requests_running"] == 0 and metrics["moeserve:num_requests_waiting"] == 0
        if idle and metrics["moeserve:kv_cache_blocks_used"] == 0:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {metrics}")
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completions_equal_llm_generate(server: ServerProcess, reference: LLM, stream: bool) -> None:
    api = client(server)
    for prompt, max_tokens in zip(PROMPTS, (16, 24, 8, 32)):
        expected = greedy(reference, prompt, max_tokens)
        if stream:
            chunks = list(
                api.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            assert finish == [expected.finish_reason]
        else:
            response = api.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0)
            text, usage = response.choices[0].text, response.usage
            assert response.choices[0].finish_reason == expected.finish_reason
        assert text == expected.text
        assert usage.completion_tokens == len(expected.token_ids)


def test_prompts_sharing_a_prefix_compute_it_once(server: ServerProcess, reference: LLM) -> None:
    """Three prompts sharing 48 tokens (three blocks of 16), sent together: one computes the
    prefix, the two others find it cached. At ep4 that takes all three placed in one of the four
    data-parallel groups; placed by load alone, each would have computed it."""
    before = wait_idle(server)
    prefix = [3 + (7 * i) % 290 for i in range(48)]
    prompts = [prefix + [5 + k] * k for k in (2, 5, 9)]
    response = client(server).completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0.0)
    for prompt, choice in zip(prompts, response.choices):
        assert choice.text == greedy(reference, prompt, 4).text
    after = wait_idle(server)
    hits = after["moeserve:prefix_cache_hits_total"] - before.get("moeserve:prefix_cache_hits_total", 0.0)
    queries = after["moeserve:prefix_cache_queries_total"] - before.get("moeserve:prefix_cache_queries_total", 0.0)
    assert (hits, queries) == (2 * 48, sum(map(len, prompts)))


def test_token_id_prompts_and_batches(server: ServerProcess, reference: LLM) -> None:
    """A batch of token-id prompts returns choice i for prompt i, each its own greedy output."""
    prompts = [[5, 17, 42, 99], [7, 8, 9, 10, 11, 12, 13], [200]]
    response = client(server).completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0.0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, response.choices):
        assert choice.text == greedy(reference, prompt, 12).text
    assert response.usage.prompt_tokens == sum(map(len, prompts))


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_equals_llm_chat(server: ServerProcess, reference: LLM, stream: bool) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is an expert?"}]
    expected = greedy(reference, messages, 20)
    api = client(server)
    if stream:
        chunks = list(
            api.chat.completions.create(
                model="tiny", messages=messages, max_completion_tokens=20, temperature=0.0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    else:
        response = api.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=20, temperature=0.0
        )
        text = response.choices[0].message.content
        assert response.choices[0].finish_reason == expected.finish_reason
        assert response.usage.completion_tokens == len(expected.token_ids)
    assert text == expected.text


def test_sampling_fields_reach_the_engine(server: ServerProcess, reference: LLM) -> None:
    """Seeded sampling, n, stop strings, vLLM's extra fields and logprobs behave as offline."""
    api = client(server)
    params = dict(temperature=0.9, top_p=0.9, seed=7)
    response = api.completions.create(
        model="tiny", prompt="Hello there", max_tokens=12, n=2, extra_body={"top_k": 20, "min_p": 0.05}, **params
    )
    expected = reference.generate(
        ["Hello there"], SamplingParams(max_tokens=12, n=2, top_k=20, min_p=0.05, **params), use_tqdm=False
    )[0]
    assert [c.text for c in response.choices] == [o.text for o in expected.outputs]

    base = greedy(reference, "The quick brown fox jumps over", 24, ignore_eos=True)
    stop = base.text[4:7]
    stopped = api.completions.create(
        model="tiny",
        prompt="The quick brown fox jumps over",
        max_tokens=24,
        temperature=0.0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].text == base.text[: base.text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    scored = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
    )
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == scored.usage.completion_tokens
    assert all(
        len(t.top_logprobs) == 3 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5) for t in tokens
    )


def test_concurrent_requests_equal_solo_outputs(server: ServerProcess) -> None:
    """32 requests of mixed lengths at once, half streamed: each equals its output when alone."""
    words = "experts route tokens across many devices while attention stays local".split()
    jobs = [(" ".join(words[: 1 + i % 6] * (1 + i % 3)), 4 + (i * 7) % 37, i % 2 == 1) for i in range(32)]

    async def run(api: openai.AsyncOpenAI, prompt: str, max_tokens: int, stream: bool) -> str:
        if not stream:
            response = await api.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0)
            return response.choices[0].text
        pieces = []
        async for chunk in await api.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
        ):
            pieces.extend(c.text for c in chunk.choices)
        return "".join(pieces)

    async def main() -> tuple[list[str], list[str]]:
        api = async_client(server)
        solo = [await run(api, *job) for job in jobs]
        together = await asyncio.gather(*(run(api, *job) for job in jobs))
        return solo, list(together)

    solo, together = asyncio.run(main())
    assert together == solo
    wait_idle(server)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: ServerProcess) -> None:
    before = wait_idle(server)
    body = {
        "model": "tiny",
        "prompt": "Hello there",
        "max_tokens": 150,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert len(got) >= 3
            assert server.metrics()["moeserve:kv_cache_blocks_used"] > 0
        # leaving the block closed the connection mid-stream
    after = wait_idle(server)
    aborted = "moeserve:request_success_total{finished_reason=abort}"
    assert after[aborted] == before[aborted] + 1
    assert after["moeserve:generation_tokens_total"] - before["moeserve:generation_tokens_total"] < 150


def test_disconnect_of_a_waiting_full_response_aborts_it(server: ServerProcess) -> None:
    before = wait_idle(server)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 180, "n": 16, "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # 16 x 180 tokens take far longer than the client waits
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    after = wait_idle(server)
    aborted = "moeserve:request_success_total{finished_reason=abort}"
    assert after[aborted] == before[aborted] + 1


def test_metrics_count_every_request_and_gap(server: ServerProcess) -> None:
    """TTFT counts each finished request once, TBT every gap between its tokens, and the SLO
    counters judge each finished request."""
    before = wait_idle(server)
    api = client(server)
    lengths = [1, 5, 9, 13]
    for max_tokens in lengths:
        api.completions.create(
            model="tiny", prompt="count me", max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True}
        )
    after = wait_idle(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("moeserve:time_to_first_token_seconds_count") == len(lengths)
    assert delta("moeserve:time_between_tokens_seconds_count") == sum(n - 1 for n in lengths)
    assert delta("moeserve:e2e_request_latency_seconds_count") == len(lengths)
    assert delta("moeserve:request_queue_time_seconds_count") == len(lengths)
    assert delta("moeserve:generation_tokens_total") == sum(lengths)
    assert delta("moeserve:request_success_total{finished_reason=length}") == len(lengths)
    assert delta("moeserve:slo_requests_total") == len(lengths)
    assert 0 <= delta("moeserve:slo_ttft_met_requests_total") <= len(lengths)
    assert after["moeserve:kv_cache_blocks_total"] > 0
    assert after["moeserve:slo_target_seconds{kind=tbt}"] == pytest.approx(0.025)


def test_small_kv_pool_preempts_and_still_matches(start_server, layout: str, reference: LLM) -> None:
    """A pool of 40 blocks of 4 tokens holds about two of these sequences: the rest wait or are
    preempted and recomputed, and every output is still the solo greedy output (the offline
    engine's, which is batch-invariant)."""
    pool = ("--block-size", "4", "--kv-cache-blocks", str(SMALL_POOL[layout][0]), "--max-model-len", "96")
    server = start_server(*LAYOUTS[layout], *pool)  # a pool must hold one whole sequence of max_model_len
    try:
        prompts = [f"request number {i} asks for many tokens" for i in range(8)]

        async def main() -> list[str]:
            api = async_client(server)
            responses = await asyncio.gather(
                *(
                    api.completions.create(
                        model="tiny", prompt=p, max_tokens=60, temperature=0.0, extra_body={"ignore_eos": True}
                    )
                    for p in prompts
                )
            )
            return [r.choices[0].text for r in responses]

        texts = asyncio.run(main())
        solo = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        assert texts == [o.outputs[0].text for o in reference.generate(prompts, solo, use_tqdm=False)]
        metrics = wait_idle(server)
        assert metrics["moeserve:num_preemptions_total"] > 0
        blocks, groups = SMALL_POOL[layout]
        assert metrics["moeserve:kv_cache_blocks_total"] == blocks * groups
    finally:
        assert server.stop() == 0
