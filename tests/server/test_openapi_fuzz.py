"""The server's own /openapi.json drives a fuzzer (schemathesis) over both generation endpoints:
requests that fit the schema and requests that break it must get a 200 or an OpenAI-format 4xx,
never a 5xx, and every KV block must come back once they are done."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode, Response
from server_utils import ServerProcess

ROUTES = ("/v1/completions", "/v1/chat/completions")
CASES_PER_ROUTE = int(os.environ.get("MOESERVE_FUZZ_CASES", "40"))
"""Generated requests per route; raise it for a longer hunt (the test stays deterministic)."""
SEED = int(os.environ.get("MOESERVE_FUZZ_SEED", "1515"))
"""Hypothesis seed; another one hunts elsewhere (each stays deterministic)."""
MAX_TOKENS = 4
"""Generated token budgets above this are lowered, so each case costs a few engine steps."""


def _steer(body: object, vocab_size: int) -> None:
    """Make a case cheap and likely to reach the engine: lower every token budget it asks for (an
    absent or null one means the whole context) and fold prompt token ids into the vocabulary (the
    schema can not know its size; out-of-vocabulary ids have their own bad-input case). Values of
    the wrong type are left alone, as the server must refuse them."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if (value is None and key != "min_tokens") or (type(value) is int and value > MAX_TOKENS):
            body[key] = MAX_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [_fold(item, vocab_size) for item in prompt]


CORE_FIELDS = {
    "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "n", "stream",
    "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "logprobs", "top_logprobs", "echo", "prompt_logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens",
}  # fmt: skip
"""What the trimmed cases keep: sampling and output shape, where the engine's bookkeeping lives."""


def _trim(case: Case) -> Case:
    """A valid case cut down to `CORE_FIELDS`, its conversation in the roles the test model's
    template renders, so that most trimmed cases run on the engine rather than stop at a 400."""
    if isinstance(case.body, dict):
        case.body = {key: value for key, value in case.body.items() if key in CORE_FIELDS}
        for index, message in enumerate(case.body.get("messages") or []):
            if message["role"] not in ("user", "assistant") and not (index == 0 and message["role"] == "system"):
                message["role"] = "user"
    return case


def _fold(item: object, vocab_size: int) -> object:
    if type(item) is int:
        return item % vocab_size if item >= 0 else item
    if isinstance(item, list):
        return [_fold(inner, vocab_size) for inner in item]
    return item


def _problem(response: Response) -> str | None:
    """What is wrong with a response, or None: a 5xx, a 4xx not in OpenAI's format, or a stream
    that reports an error or does not end with [DONE] (unless the fuzzer stopped reading it: a
    client leaving early, which aborts the request)."""
    if response.status_code >= 500:
        return "server error"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return "error body not in OpenAI's format"
        if set(error) != {"message", "type", "param", "code"} or not (
            isinstance(error["message"], str) and error["message"]
        ):
            return "error body not in OpenAI's format"
        return None
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        if not response.stream_cut_short and (not events or events[-1] != "[DONE]"):
            return "stream does not end with [DONE]"
        if any('"error"' in event and "error" in json.loads(event) for event in events if event != "[DONE]"):
            return "stream reports an error"
        return None
    body = response.json()
    return None if body.get("choices") else "200 without choices"


def _server_gone(server: ServerProcess, case: Case, error: Exception) -> str:
    """Why the server stopped answering, for the failure message: the request that was being
    sent, whether the process is still there, and the end of its log."""
    code = server.proc.poll()
    state = "still running" if code is None else f"exited with {code}"
    tail = "\n".join(server.log().splitlines()[-40:])
    return f"{case.operation.path} {case.body!r}: {error}\nthe server is {state}; its log ends:\n{tail}"


def fuzz(server: ServerProcess, vocab_size: int, cases_per_route: int) -> tuple[list[str], dict[int, int]]:
    """Problems found, and how many responses had each status."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    session = requests.Session()
    problems: list[str] = []
    statuses: dict[int, int] = {}
    for route in ROUTES:
        operation = schema[route]["POST"]
        valid = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
        cases = st.one_of(valid, valid.map(_trim), operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

        @seed(SEED)
        @settings(
            max_examples=cases_per_route,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def send(case) -> None:
            _steer(case.body, vocab_size)
            try:
                response = case.call(base_url=server.url, session=session, timeout=60)
            except requests.ConnectionError as exc:
                raise AssertionError(_server_gone(server, case, exc)) from exc
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            problem = _problem(response)
            if problem is not None:
                problems.append(
                    f"{case.operation.path} {case.body!r} -> {response.status_code} {problem}: {response.text[:300]}"
                )

        send()
    return problems, statuses


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    """The metrics once no request runs or waits and no KV block is held (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        busy = (
            metrics["moeserve:kv_cache_blocks_used"]
            + metrics["moeserve:num_requests_running"]
            + metrics["moeserve:num_requests_waiting"]
        )
        if busy == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_fuzzed_generation_requests_get_no_5xx_and_leak_no_kv(server: ServerProcess, server_checkpoint: Path) -> None:
    vocab_size = json.loads((server_checkpoint / "config.json").read_text())["vocab_size"]
    problems, statuses = fuzz(server, vocab_size, CASES_PER_ROUTE)
    assert not problems, "\n".join(problems)
    assert sum(statuses.values()) >= len(ROUTES) * CASES_PER_ROUTE * 0.9, statuses
    assert statuses.get(200) and any(400 <= status < 500 for status in statuses), statuses  # both kinds seen
    metrics = wait_idle(server)
    assert metrics["moeserve:kv_cache_blocks_used"] == 0
    assert metrics["moeserve:num_requests_running"] == 0 and metrics["moeserve:num_requests_waiting"] == 0
