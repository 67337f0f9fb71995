"""Bad input, auth, load shedding and shutdown: clear OpenAI-format errors, nothing leaked, and
the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from server_utils import MAX_MODEL_LEN, ServerProcess

OK_COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
LONG_TEXT = "word " * 400_000  # 2 MB: under the body limit, far past what the context holds
MANY_MESSAGES = [{"role": "user", "content": "hello there " * 40}] * 3000
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

BAD_REQUESTS = [
    # (id, path, body (dict, or raw bytes), status, param)
    ("invalid-json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not-an-object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("missing-prompt", "/v1/completions", {"model": "tiny", "max_tokens": 4}, 400, "prompt"),
    ("wrong-type", "/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, 400, "temperature"),
    ("unknown-model", "/v1/completions", {**OK_COMPLETION, "model": "gpt-9"}, 404, "model"),
    ("empty-messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    (
        "bad-role",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
    ),
    (
        "prompt-too-long",
        "/v1/completions",
        {**OK_COMPLETION, "prompt": list(range(3, 3 + MAX_MODEL_LEN + 8))},
        400,
        "prompt",
    ),
    (
        "prompt-plus-max-tokens-too-long",
        "/v1/completions",
        {**OK_COMPLETION, "max_tokens": MAX_MODEL_LEN},
        400,
        "max_tokens",
    ),
    ("max-tokens-zero", "/v1/completions", {**OK_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    (
        "max-completion-tokens-negative",
        "/v1/chat/completions",
        {**OK_CHAT, "max_completion_tokens": -1},
        400,
        "max_completion_tokens",
    ),
    ("temperature-negative", "/v1/completions", {**OK_COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ("top-p-zero", "/v1/completions", {**OK_COMPLETION, "top_p": 0.0}, 400, "top_p"),
    ("top-p-above-one", "/v1/chat/completions", {**OK_CHAT, "top_p": 1.5}, 400, "top_p"),
    ("n-too-large", "/v1/completions", {**OK_COMPLETION, "n": 1000}, 400, "n"),
    ("token-out-of-vocab", "/v1/completions", {**OK_COMPLETION, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", {**OK_COMPLETION, "prompt": []}, 400, "prompt"),
    # Found by the schemathesis fuzz: integers past 64 bits used to stop the engine core (503s after).
    ("seed-past-64-bits", "/v1/completions", {**OK_COMPLETION, "seed": 2**64}, 400, "seed"),
    ("seed-below-int64", "/v1/completions", {**OK_COMPLETION, "seed": -(2**63) - 1}, 400, "seed"),
    ("top-k-past-64-bits", "/v1/chat/completions", {**OK_CHAT, "top_k": 2**64}, 400, "top_k"),
    (
        "stop-token-id-past-64-bits",
        "/v1/completions",
        {**OK_COMPLETION, "stop_token_ids": [2**64]},
        400,
        "stop_token_ids",
    ),
    # Inputs whose cost grows with the request (moeserve/api/input_bounds.py).
    ("stop-strings-too-many", "/v1/completions", {**OK_COMPLETION, "stop": ["x"] * 33}, 400, "stop"),
    ("stop-string-too-long", "/v1/chat/completions", {**OK_CHAT, "stop": "y" * 1025}, 400, "stop"),
    (
        "stop-token-ids-too-many",
        "/v1/completions",
        {**OK_COMPLETION, "stop_token_ids": [5] * 1025},
        400,
        "stop_token_ids",
    ),
    (
        "prompt-logprobs-too-many",
        "/v1/completions",
        {**OK_COMPLETION, "prompt_logprobs": 10_000},
        400,
        "prompt_logprobs",
    ),
    ("prompt-logprobs-negative", "/v1/chat/completions", {**OK_CHAT, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("prompt-text-past-context", "/v1/completions", {**OK_COMPLETION, "prompt": LONG_TEXT}, 400, "prompt"),
    ("thousands-of-messages", "/v1/chat/completions", {**OK_CHAT, "messages": MANY_MESSAGES}, 400, "messages"),
    ("tokenize-past-context", "/tokenize", {"prompt": LONG_TEXT}, 400, "prompt"),
    ("tokenize-both", "/tokenize", {"prompt": "Hi", "messages": OK_CHAT["messages"]}, 400, "prompt"),
    ("tokenize-neither", "/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("tokenize-unknown-model", "/tokenize", {"model": "gpt-9", "prompt": "Hi"}, 404, "model"),
    (
        "tokenize-generation-prompt-and-continue",
        "/tokenize",
        {"messages": OK_CHAT["messages"], "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
    ("detokenize-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize-not-ids", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("detokenize-unknown-model", "/detokenize", {"model": "gpt-9", "tokens": [5]}, 404, "model"),
]


def post(server: ServerProcess, path: str, body, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            f"{server.url}{path}",
            content=body,
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=timeout,
        )
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    "path, body, status, param", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_input_gets_a_clear_error(server: ServerProcess, path: str, body, status: int, param: str | None) -> None:
    assert_openai_error(post(server, path, body), status, param)


def test_text_past_the_context_is_refused_before_it_is_tokenized(server: ServerProcess) -> None:
    """2 MB of prompt, or 3,000 messages, would hold the one prompt thread every request waits on
    for seconds; counted in characters first, they are refused at once, and an ordinary request
    sent beside them is not held up."""
    bodies = [("/v1/completions", {**OK_COMPLETION, "prompt": LONG_TEXT})] * 3
    bodies += [("/v1/chat/completions", {**OK_CHAT, "messages": MANY_MESSAGES})] * 3

    async def attack_and_serve() -> tuple[list[tuple[int, float]], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

            async def timed(path: str, body: dict) -> tuple[int, float]:
                start = time.monotonic()
                response = await client.post(path, json=body)
                return response.status_code, time.monotonic() - start

            attacks = [asyncio.create_task(timed(path, body)) for path, body in bodies]
            ordinary = await timed("/v1/chat/completions", OK_CHAT)
            assert ordinary[0] == 200
            return list(await asyncio.gather(*attacks)), ordinary[1]

    refused, ordinary_s = asyncio.run(attack_and_serve())
    assert all(status == 400 for status, _ in refused), refused
    assert max(seconds for _, seconds in refused) < 5.0, refused  # the bodies' upload and parse, no tokenizing
    assert ordinary_s < 5.0


def test_unknown_route_and_method_use_the_error_format(server: ServerProcess) -> None:
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions"), 405)


def test_server_still_serves_after_bad_input_and_leaks_nothing(server: ServerProcess) -> None:
    for _, path, body, _, _ in BAD_REQUESTS:
        post(server, path, body)
    response = post(server, "/v1/completions", OK_COMPLETION)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    metrics = server.metrics()
    assert metrics["moeserve:kv_cache_blocks_used"] == 0
    assert metrics["moeserve:num_requests_running"] == 0 and metrics["moeserve:num_requests_waiting"] == 0


def test_models_health_version(server: ServerProcess) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tokenize_detokenize_round_trip(server: ServerProcess, server_checkpoint) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_checkpoint)
    text = "Mixture of experts, tokenized"
    body = post(server, "/tokenize", {"model": "tiny", "prompt": text}).json()
    ids = tokenizer.encode(text)
    assert body == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    assert post(server, "/detokenize", {"model": "tiny", "tokens": plain["tokens"]}).json() == {"prompt": text}
    # Messages count as the chat route's prompt, through the same template.
    chat = post(server, "/tokenize", {"messages": OK_CHAT["messages"]}).json()
    usage = post(server, "/v1/chat/completions", {**OK_CHAT, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"] == len(chat["tokens"])
    turns = [*OK_CHAT["messages"], {"role": "assistant", "content": "Hel"}]
    open_turn = post(
        server, "/tokenize", {"messages": turns, "add_generation_prompt": False, "continue_final_message": True}
    ).json()
    rendered = tokenizer.apply_chat_template(turns, continue_final_message=True, tokenize=False)
    assert open_turn["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert rendered.endswith("Hel")
    assert server.metrics()["moeserve:http_requests_total{route=/tokenize,status=200}"] >= 4


def test_echo_and_prompt_logprobs_match_transformers(server: ServerProcess, server_checkpoint) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox jumps over"
    ids = post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(server_checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
    expected = [None] + [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    request = {**OK_COMPLETION, "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 2, "prompt_logprobs": 1}
    choice = post(server, "/v1/completions", request).json()["choices"][0]
    echoed = choice["logprobs"]["token_logprobs"][: len(ids)]
    assert echoed[0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert all(abs(got - want) < 1e-4 for got, want in zip(echoed[1:], expected[1:]))
    assert all(1 <= len(top) <= 3 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])
    vllm_form = choice["prompt_logprobs"]
    assert len(vllm_form) == len(ids) and vllm_form[0] is None
    for i in range(1, len(ids)):
        entry = vllm_form[i][str(ids[i])]
        assert abs(entry["logprob"] - expected[i]) < 1e-4
        assert entry["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert entry["decoded_token"] == tokenizer_piece(server, ids[i])
        assert str(ref[i - 1].argmax().item()) in vllm_form[i]
    # Streamed, the echoed prompt's logprobs come with the first chunk; unasked, nothing changes.
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**request, "stream": True}, timeout=60) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == echoed
    plain = post(server, "/v1/completions", {**OK_COMPLETION, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert "prompt_logprobs" not in plain
    chat = post(server, "/v1/chat/completions", {**OK_CHAT, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def tokenizer_piece(server: ServerProcess, token_id: int) -> str:
    return post(server, "/detokenize", {"tokens": [token_id]}).json()["prompt"]


@pytest.fixture(scope="module")
def guarded_server(start_server):
    """API key from the environment, a 4 KiB body limit, one running sequence, one waiting."""
    server = start_server(
        "--max-request-body", "4096", "--max-num-seqs", "1", "--max-waiting", "1", env={"MOESERVE_API_KEY": KEY}
    )
    yield server
    server.stop()


def test_api_key_is_required_on_v1_only(guarded_server: ServerProcess) -> None:
    assert_openai_error(post(guarded_server, "/v1/completions", OK_COMPLETION), 401)
    assert_openai_error(post(guarded_server, "/v1/completions", OK_COMPLETION, {"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(f"{guarded_server.url}/v1/models"), 401)
    assert post(guarded_server, "/v1/completions", OK_COMPLETION, AUTH).status_code == 200
    assert httpx.get(f"{guarded_server.url}/health").status_code == 200
    assert httpx.get(f"{guarded_server.url}/metrics").status_code == 200
    # As vLLM: the key guards /v1 only, so /tokenize and /detokenize at the root answer without it.
    assert post(guarded_server, "/tokenize", {"prompt": "Hi"}).status_code == 200
    assert post(guarded_server, "/detokenize", {"tokens": [5]}).status_code == 200


def test_oversized_body_is_refused(guarded_server: ServerProcess) -> None:
    big = {**OK_COMPLETION, "prompt": "x" * 8192}
    assert_openai_error(post(guarded_server, "/v1/completions", big, AUTH), 413)

    def chunked():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1024
        yield b'"}'

    response = httpx.post(
        f"{guarded_server.url}/v1/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert_openai_error(response, 413)
    assert post(guarded_server, "/v1/completions", OK_COMPLETION, AUTH).status_code == 200


def test_full_queue_sheds_load_with_retry_after(guarded_server: ServerProcess) -> None:
    """At most one request runs and one waits; the rest get 429 + Retry-After at once, and the
    admitted ones finish (how many are admitted depends on when the engine steps)."""
    body = {**OK_COMPLETION, "max_tokens": 60, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded_server.url, headers=AUTH, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

    responses = asyncio.run(main())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    for response in responses:
        if response.status_code == 429:
            assert_openai_error(response, 429)
            assert int(response.headers["Retry-After"]) >= 1
    assert post(guarded_server, "/v1/completions", OK_COMPLETION, AUTH).status_code == 200


def test_sigterm_drains_running_streams_then_exits_zero(start_server) -> None:
    """Steps of at least 20 ms: the 80-token stream is still running when SIGTERM comes (a fast
    tiny model under a loaded machine could otherwise finish it, coalesced into one chunk, before
    the client read its first line)."""
    server = start_server("--min-step-time-ms", "20")
    body = {**OK_COMPLETION, "max_tokens": 80, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            refused = httpx.post(f"{server.url}/v1/completions", json=OK_COMPLETION, timeout=5).status_code
        except httpx.TransportError:
            refused = None  # the listener is closed
        assert refused in (None, 503)
        rest = [line for line in lines if line.startswith("data: ")]
    assert first and rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join([first, *rest]).replace(" ", "")
    assert server.proc.wait(30) == 0
    assert "shut down cleanly" in server.log()
