"""The server's own /openapi.json drives a fuzzer (schemathesis) over every route it describes.
The document must be valid OpenAPI 3.1 (checked by openapi-spec-validator: schemathesis' Python
API fills in an undeclared path parameter by itself, where its command line stops with a schema
error); requests that fit the schema and requests that break it must get a 2xx the document
describes or an OpenAI-format 4xx, never a 5xx, and every KV block must come back once they are
done. The generation routes get most of the cases (they reach the engine); the others, cheap and
with small inputs, a few each."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from openapi_spec_validator import OpenAPIV31SpecValidator
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.schemas import APIOperation
from server_utils import ServerProcess

GENERATION = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses")}
CASES_PER_ROUTE = int(os.environ.get("MOESERVE_FUZZ_CASES", "40"))
"""Generated requests per generation route; raise it for a longer hunt (the test stays deterministic)."""
CASES_PER_OTHER_ROUTE = max(1, CASES_PER_ROUTE // 4)
"""Generated requests per other route, at most (a route without inputs has fewer to make)."""
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
"""schemathesis' own checks on every response: no 5xx, and a status, a content type and a body
that the document declares for the route."""
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
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
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
    "input", "instructions", "max_output_tokens",
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


def _problem(response: Response, route: str) -> str | None:
    """What schemathesis' checks cannot see in a response, or None: a 4xx not in OpenAI's format,
    a stream that reports an error or does not end as its route's streams end (unless the fuzzer
    stopped reading it: a client leaving early, which aborts the request), or a completion's 200
    without choices."""
    if 400 <= response.status_code < 500:
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
        data = [json.loads(event) for event in events if event != "[DONE]"]
        if route == "/v1/responses":  # typed events, the whole response last
            ended = bool(data) and data[-1].get("type") in ("response.completed", "response.incomplete")
        else:
            ended = bool(events) and events[-1] == "[DONE]"
        if not response.stream_cut_short and not ended:
            return "stream does not end as its route's streams end"
        if any("error" in event or event.get("type") == "error" for event in data):
            return "stream reports an error"
        return None
    if route in ("/v1/completions", "/v1/chat/completions") and response.status_code == 200:
        return None if response.json().get("choices") else "200 without choices"
    return None


def _server_gone(server: ServerProcess, case: Case, error: Exception) -> str:
    """Why the server stopped answering, for the failure message: the request that was being
    sent, whether the process is still there, and the end of its log."""
    code = server.proc.poll()
    state = "still running" if code is None else f"exited with {code}"
    tail = "\n".join(server.log().splitlines()[-40:])
    return f"{case.operation.path} {case.body!r}: {error}\nthe server is {state}; its log ends:\n{tail}"


def _stored_response(server: ServerProcess) -> str:
    """The id of a fresh stored response, for the routes that read or delete one: fuzzed ids
    alone would only ever be unknown (a 404)."""
    body = {"input": "hello", "max_output_tokens": MAX_TOKENS}
    response = requests.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _cases(operation: APIOperation, server: ServerProcess) -> st.SearchStrategy[Case]:
    """Valid and invalid cases; a generation route's valid ones also trimmed to what reaches
    the engine, a route with a `response_id` also naming a stored response."""
    valid = operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
    strategies = [valid, operation.as_strategy(generation_mode=GenerationMode.NEGATIVE)]
    if (operation.method.upper(), operation.path) in GENERATION:
        strategies.append(valid.map(_trim))
    if "{response_id}" in operation.path:
        stored = _stored_response(server)
        strategies.append(valid.map(lambda case: _naming(case, stored)))
    return st.one_of(strategies)


def _naming(case: Case, response_id: str) -> Case:
    case.path_parameters = {**(case.path_parameters or {}), "response_id": response_id}
    return case


def fuzz(server: ServerProcess, vocab_size: int, cases_per_route: int) -> tuple[list[str], dict[str, Counter]]:
    """Problems found, and by route (`METHOD /path`) how many responses had each status. An
    operation schemathesis cannot load (a broken reference, say) fails here, naming its route."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    session = requests.Session()
    problems: list[str] = []
    statuses: dict[str, Counter] = {}
    for result in schema.get_all_operations():
        operation = result.ok()  # raises a schema error, naming the route
        generation = (operation.method.upper(), operation.path) in GENERATION
        cases = cases_per_route if generation else CASES_PER_OTHER_ROUTE
        route = f"{operation.method.upper()} {operation.path}"
        statuses[route] = _fuzz_route(operation, server, session, vocab_size, cases, problems)
    return problems, statuses


def _fuzz_route(
    operation: APIOperation,
    server: ServerProcess,
    session: requests.Session,
    vocab_size: int,
    max_examples: int,
    problems: list[str],
) -> Counter:
    """Send up to `max_examples` cases to one route, adding what is wrong to `problems`; the
    responses' statuses."""
    counts: Counter = Counter()

    @seed(SEED)
    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=_cases(operation, server))
    def send(case: Case) -> None:
        _steer(case.body, vocab_size)
        try:
            response = case.call(base_url=server.url, session=session, timeout=60)
        except requests.ConnectionError as exc:
            raise AssertionError(_server_gone(server, case, exc)) from exc
        counts[response.status_code] += 1
        found = [] if (problem := _problem(response, operation.path)) is None else [problem]
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, FailureGroup) as exc:
            found.append(str(exc).strip() or type(exc).__name__)
        problems.extend(
            f"{operation.method.upper()} {operation.path} {case.path_parameters or ''} {case.body!r} -> "
            f"{response.status_code} {problem}: {response.text[:300]}"
            for problem in found
        )

    send()
    return counts


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


def test_fuzzed_requests_to_every_route_get_no_5xx_and_leak_no_kv(
    server: ServerProcess, server_checkpoint: Path
) -> None:
    vocab_size = json.loads((server_checkpoint / "config.json").read_text())["vocab_size"]
    document = server_openapi(server)
    assert not [error.message for error in OpenAPIV31SpecValidator(document).iter_errors()]
    problems, statuses = fuzz(server, vocab_size, CASES_PER_ROUTE)
    print("\n[fuzz] statuses by route: " + "; ".join(f"{route} {dict(c)}" for route, c in sorted(statuses.items())))
    assert not problems, "\n".join(problems)
    described = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    assert {tuple(route.split(" ", 1)) for route in statuses} == described  # every route was fuzzed
    assert all(sum(counts.values()) >= 1 for counts in statuses.values()), statuses
    for route in GENERATION:
        counts = statuses[" ".join(route)]
        assert sum(counts.values()) >= CASES_PER_ROUTE * 0.9, (route, counts)
        assert counts.get(200) and any(400 <= status < 500 for status in counts), (route, counts)  # both kinds
    metrics = wait_idle(server)
    assert metrics["moeserve:kv_cache_blocks_used"] == 0
    assert metrics["moeserve:num_requests_running"] == 0 and metrics["moeserve:num_requests_waiting"] == 0


def server_openapi(server: ServerProcess) -> dict:
    return requests.get(f"{server.url}/openapi.json", timeout=10).json()
