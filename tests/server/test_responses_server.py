"""The Responses API and reasoning outputs through the real server and the official openai client.

The random model writes no `</think>`: under `--reasoning-parser deepseek_r1` (whose template
opens the thinking) all its text is reasoning, which is enough to test the plumbing; the parsers
themselves are tested on model-like text in tests/unit/test_reasoning_parsers.py. The other server
has no reasoning parser, so its outputs are answers.
Calls and JSON come from forced tool choices and schemas, as in test_structured_server.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from server_utils import ServerProcess

TOOL_CONTEXT = 2048  # the tool signatures take about 700 tokens of the test vocabulary
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "minimum": 0, "maximum": 30}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(start_server, make_checkpoint) -> Iterator[ServerProcess]:
    checkpoint = make_checkpoint("qwen3_moe", 0, max_position_embeddings=TOOL_CONTEXT)
    args = ("--tool-call-parser", "hermes", "--max-model-len", str(TOOL_CONTEXT))
    server = start_server(*args, checkpoint=checkpoint)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def r1_server(start_server) -> Iterator[ServerProcess]:
    server = start_server("--reasoning-parser", "deepseek_r1")
    yield server
    server.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_reasoning_is_split_whole_and_streamed(r1_server: ServerProcess) -> None:
    c = client(r1_server)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "think"}], max_tokens=24, temperature=0.0)
    message = c.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content is None  # no </think>: all thinking
    streamed_reasoning, streamed_content = "", ""
    for chunk in c.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, "")


def test_structured_outputs_constrain_the_answer_not_the_reasoning(r1_server: ServerProcess) -> None:
    """The thinking is free (the grammar only keeps `</think>` out of it): the random model thinks
    until it runs out of tokens, where a grammar over the whole output would have forced JSON.
    That the answer after `</think>` is held to the schema is tested on the grammar itself
    (tests/unit/test_structured_grammar.py)."""
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
    choice = (
        client(r1_server)
        .chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "a pet"}],
            response_format=response_format,
            max_tokens=40,
            temperature=0.0,
        )
        .choices[0]
    )
    reasoning = choice.message.model_extra["reasoning_content"]
    assert choice.finish_reason == "length" and reasoning and "</think>" not in reasoning
    assert choice.message.content is None


def test_responses_carry_reasoning_items(r1_server: ServerProcess) -> None:
    c = client(r1_server)
    response = c.responses.create(model="tiny", input="think", max_output_tokens=16, temperature=0.0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text and response.output_text == ""
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens == 16
    events = list(c.responses.create(model="tiny", input="think", max_output_tokens=16, temperature=0.0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text and events[-1].type == "response.incomplete"


def test_a_plain_response_whole_and_streamed(server: ServerProcess) -> None:
    c = client(server)
    kwargs = dict(model="tiny", input="hello", instructions="Be brief.", max_output_tokens=12, temperature=0.0)
    response = c.responses.create(**kwargs)
    assert response.object == "response" and response.id.startswith("resp_")
    [message] = response.output
    assert message.type == "message" and response.output_text and response.instructions == "Be brief."
    assert response.usage.output_tokens == 12 and response.usage.total_tokens > 12
    events = list(c.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == response.output_text == events[-1].response.output_text  # greedy: the same tokens


def test_a_function_call_then_its_output_chained(server: ServerProcess) -> None:
    c = client(server)
    first = c.responses.create(
        model="tiny", input="add 2 and 3", tools=[ADD], tool_choice="required", temperature=0.0, max_output_tokens=200
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "add" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    streamed = list(
        c.responses.create(
            model="tiny",
            input="add 2 and 3",
            tools=[ADD],
            tool_choice="required",
            temperature=0.0,
            max_output_tokens=200,
            stream=True,
        )
    )
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(call.arguments for call in calls)
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "5"} for call in calls]
    second = c.responses.create(
        model="tiny", previous_response_id=first.id, input=outputs, tools=[ADD], max_output_tokens=8, temperature=0.0
    )
    assert second.previous_response_id == first.id and second.output_text
    # the chain's prompt holds the first turn: it is longer than the outputs alone would make it
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_json_schema_format(server: ServerProcess) -> None:
    response = client(server).responses.create(
        model="tiny",
        input="a pet",
        text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}},
        max_output_tokens=80,
        temperature=1.0,
    )
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), PET)


def test_stored_responses_are_found_and_forgotten(server: ServerProcess) -> None:
    c = client(server)
    response = c.responses.create(model="tiny", input="hi", max_output_tokens=4)
    assert c.responses.retrieve(response.id).output_text == response.output_text
    c.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(response.id)
    unstored = c.responses.create(model="tiny", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        c.responses.create(model="tiny", input="hi", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"


def test_a_small_store_evicts_the_oldest_and_says_so(start_server, make_checkpoint) -> None:
    """Within --responses-store-bytes: the gauge stays under the budget, the newest of a chain
    continues it whole, and a request naming an evicted response hears it was evicted and why."""
    checkpoint = make_checkpoint("qwen3_moe", 0, max_position_embeddings=TOOL_CONTEXT)
    server = start_server(
        "--responses-store-bytes", "8KiB", "--max-model-len", str(TOOL_CONTEXT), checkpoint=checkpoint
    )
    c = client(server)
    chain = []
    for turn in range(8):
        previous = chain[-1].id if chain else None
        chain.append(
            c.responses.create(
                model="tiny", input=f"turn {turn} " * 5, max_output_tokens=8, previous_response_id=previous
            )
        )
        assert 0 < server.metrics()["moeserve:responses_store_bytes"] <= 8 * 1024
    assert chain[-1].usage.input_tokens > 4 * chain[0].usage.input_tokens  # the whole conversation, kept once
    assert c.responses.retrieve(chain[-1].id).id == chain[-1].id
    continued = c.responses.create(model="tiny", input="and", max_output_tokens=4, previous_response_id=chain[-1].id)
    assert continued.usage.input_tokens > chain[-1].usage.input_tokens
    with pytest.raises(openai.NotFoundError) as evicted:
        c.responses.create(model="tiny", input="hi", previous_response_id=chain[0].id)
    error = evicted.value.body
    assert error["param"] == "previous_response_id"
    assert "was evicted" in error["message"] and "--responses-store-bytes" in error["message"], error
    server.stop()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "image_generation_call"}]}, "input"),
        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ],
)
def test_errors_name_the_responses_field(server: ServerProcess, body: dict, param: str) -> None:
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_metrics_have_no_created_series(server: ServerProcess) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "moeserve:generation_tokens_total" in text and "_created" not in text


def test_chat_template_kwargs_reach_the_template_but_not_its_caller(r1_server: ServerProcess) -> None:
    url = f"{r1_server.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(url, json={**body, "chat_template_kwargs": {"enable_thinking": False}}, timeout=30).is_success
    reply = httpx.post(url, json={**body, "chat_template_kwargs": {"tokenize": False}}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template_kwargs"
