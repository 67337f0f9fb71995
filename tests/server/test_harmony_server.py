"""`moeserve launch` on a gpt-oss checkpoint whose tokenizer speaks harmony: the chat route renders
the conversation in harmony (checked token by token through `prompt_logprobs`), reads the output
back the same way streamed and not, and refuses what harmony's reader cannot honour."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers.harmony_cases import CONVERSATION, TOOLS
from server_utils import ServerProcess

from moeserve.api.harmony import render_conversation
from moeserve.checkpoints import MakeModelSpec, make_model
from moeserve.engine.tokenizer import load_tokenizer

MESSAGES = [
    {
        **message,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    if message.get("tool_calls")
    else message
    for message in CONVERSATION
]
CHAT = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def harmony(start_server, tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerProcess, Path]:
    folder = make_model(MakeModelSpec(arch="gpt_oss", vocab=320, chat_format="harmony"), tmp_path_factory.mktemp("h"))
    return start_server("--max-model-len", "1024", checkpoint=folder), folder


def chat(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_the_prompt_is_rendered_in_harmony(harmony: tuple[ServerProcess, Path]) -> None:
    server, folder = harmony
    response = chat(server, {**CHAT, "prompt_logprobs": 0, "reasoning_effort": "low"})
    assert response.status_code == 200, response.text
    body = response.json()
    text = render_conversation(CONVERSATION, TOOLS, reasoning_effort="low")
    expected = load_tokenizer(folder).encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(expected)
    logprobs = body["prompt_logprobs"]
    assert logprobs[0] is None and all(str(token) in entry for token, entry in zip(expected[1:], logprobs[1:]))


def test_tokenize_renders_as_the_chat_route(harmony: tuple[ServerProcess, Path]) -> None:
    server, folder = harmony
    body = {"messages": MESSAGES, "tools": TOOLS}
    tokens = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]
    assert tokens == load_tokenizer(folder).encode(render_conversation(CONVERSATION, TOOLS), add_special_tokens=False)
    refused = httpx.post(f"{server.url}/tokenize", json={**body, "continue_final_message": True}, timeout=60)
    assert refused.status_code == 400 and "continue_final_message" in refused.text


def test_the_responses_api_goes_through_harmony(harmony: tuple[ServerProcess, Path]) -> None:
    server, _ = harmony
    body = {"model": "tiny", "input": "Weather in Rome?", "max_output_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["input_tokens"] == len(
        load_tokenizer(harmony[1]).encode(
            render_conversation([{"role": "user", "content": "Weather in Rome?"}], None), add_special_tokens=False
        )
    )


def test_streamed_and_whole_answers_agree(harmony: tuple[ServerProcess, Path]) -> None:
    server, _ = harmony
    message = chat(server, CHAT).json()["choices"][0]["message"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=120) as r:
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(line)["choices"][0]["delta"] for line in lines[:-1]]
    streamed = {key: "".join(d.get(key) or "" for d in deltas) for key in ("content", "reasoning_content")}
    assert streamed == {key: message.get(key) or "" for key in ("content", "reasoning_content")}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
    ],
)
def test_what_harmony_cannot_honour_is_a_clear_400(
    harmony: tuple[ServerProcess, Path], extra: dict, param: str
) -> None:
    server, _ = harmony
    response = chat(server, {**CHAT, **extra})
    assert response.status_code == 400, response.text
    assert param in json.dumps(response.json()["error"])
