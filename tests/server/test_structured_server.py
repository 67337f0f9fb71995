"""Structured outputs and tool calls through the real server and the official openai client, on a
random model: whatever it samples, every output parses and validates against its schema.

MOESERVE_TEST_SCHEMAS sets how many random schemas run (default 12; the issue's acceptance run
uses 50).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from helpers.random_schema import random_schema
from pydantic import BaseModel, Field
from server_utils import ServerProcess

NUM_SCHEMAS = int(os.environ.get("MOESERVE_TEST_SCHEMAS", "12"))
MAX_TOKENS = 170  # a plain chat prompt takes about 20
TOOL_CONTEXT = 2048  # the tool signatures take about 700 tokens of this byte-level vocabulary, calls 170 each


@pytest.fixture(scope="module")
def tool_server(start_server, make_checkpoint) -> Iterator[ServerProcess]:
    checkpoint = make_checkpoint("qwen3_moe", 0, max_position_embeddings=TOOL_CONTEXT)
    server = start_server("--tool-call-parser", "hermes", "--max-model-len", str(TOOL_CONTEXT), checkpoint=checkpoint)
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(c: openai.OpenAI, **kwargs):
    return c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "answer"}], max_tokens=MAX_TOKENS, **kwargs
    )


class Pet(BaseModel):
    name: str = Field(max_length=5)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


def test_parse_with_a_pydantic_model(tool_server: ServerProcess) -> None:
    completion = client(tool_server).chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "a pet"}], response_format=Pet, max_tokens=MAX_TOKENS
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)


def test_random_schemas_always_validate(tool_server: ServerProcess) -> None:
    c = client(tool_server)
    rng = random.Random(15)
    for i in range(NUM_SCHEMAS):
        schema = random_schema(rng)
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        out = chat(c, response_format=response_format, temperature=1.0, seed=i)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        try:
            value = json.loads(choice.message.content)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{choice.message.content!r} for {schema}") from exc
        jsonschema.validate(value, schema)


def test_regex_choice_and_grammar_on_completions(tool_server: ServerProcess) -> None:
    c = client(tool_server)
    pattern = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
    for seed in range(3):
        text = (
            c.completions.create(
                model="tiny", prompt="mail:", max_tokens=MAX_TOKENS, seed=seed, extra_body={"guided_regex": pattern}
            )
            .choices[0]
            .text
        )
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", 'maybe "so"']
    out = c.completions.create(model="tiny", prompt="?", n=4, max_tokens=20, extra_body={"guided_choice": choices})
    assert all(ch.text in choices and ch.finish_reason == "stop" for ch in out.choices)
    out = c.completions.create(
        model="tiny",
        prompt="?",
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": 'root ::= "(" [0-9] ")" | "ok"'}},
    )
    assert re.fullmatch(r"\([0-9]\)|ok", out.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_regex": "(("}, "guided_regex", "invalid regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
            "response_format",
            "Unsupported type",
        ),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "give one output constraint"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": []},
            "tool_choice",
            "needs tools",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_and_leaks_nothing(tool_server: ServerProcess, body, param, words) -> None:
    response = httpx.post(
        f"{tool_server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    metrics = tool_server.metrics()
    assert metrics["moeserve:kv_cache_blocks_used"] == 0 and metrics["moeserve:num_requests_waiting"] == 0


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _streamed(c: openai.OpenAI, **kwargs) -> tuple[list[tuple[str, str]], str | None]:
    """(name, joined arguments) per streamed call, and the finish reason."""
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in chat(c, stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.id.startswith("call_") and call.type == "function"
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
            finish = choice.finish_reason or finish
    return [(names[i], arguments[i]) for i in sorted(names)], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"]
)
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_tool_calls_parse_validate_and_stream_alike(tool_server: ServerProcess, tool_choice, parallel) -> None:
    c = client(tool_server)
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, temperature=0.0, parallel_tool_calls=parallel)
    choice = chat(c, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if isinstance(tool_choice, dict) or not parallel:
        assert len(calls) == 1
    if isinstance(tool_choice, dict):
        assert calls[0][0] == "add"
    assert _streamed(c, **kwargs) == (calls, "tool_calls")  # greedy: the same tokens, streamed


def test_auto_reads_plain_text_as_content(tool_server: ServerProcess) -> None:
    """The random model never writes <tool_call>: "auto" returns its text as content (the parsers
    themselves are tested on model-like text in tests/unit/test_tool_parsers.py)."""
    choice = chat(client(tool_server), tools=TOOLS, temperature=0.0).choices[0]
    assert not choice.message.tool_calls and choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_conversation_with_tool_results_continues(tool_server: ServerProcess) -> None:
    """The calls a forced request made, sent back with their results, render and continue: the
    demo template writes the assistant's calls and the tool messages (a 200 with a reply)."""
    c = client(tool_server)
    first = chat(c, tools=TOOLS, tool_choice="required", temperature=0.0).choices[0].message
    history = [
        {"role": "user", "content": "answer"},
        {"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in first.tool_calls]},
        *({"role": "tool", "tool_call_id": t.id, "content": "42"} for t in first.tool_calls),
    ]
    reply = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 700
