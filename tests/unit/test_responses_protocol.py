"""Responses API input items as the chat messages the template renders, and a response's output
as the turn a chained response continues."""

from __future__ import annotations

import pytest

from moeserve.api.errors import APIError
from moeserve.api.protocol import ChatCompletionRequest, parse_request
from moeserve.api.responses_protocol import ResponsesRequest, input_messages, output_messages


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "add"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "1"},
    ]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "add"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]  # one turn, two calls
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "1"}


@pytest.mark.parametrize(
    "item", [{"type": "web_search_call"}, {"role": "tool", "content": "x"}, {"type": "function_call", "name": "f"}]
)
def test_unsupported_items_are_a_400_on_input(item: dict) -> None:
    with pytest.raises(APIError) as error:
        input_messages([item])
    assert error.value.param == "input" and error.value.status_code == 400


def test_the_chat_body_carries_tools_format_and_history() -> None:
    request = parse_request(
        ResponsesRequest,
        {
            "input": "hi",
            "instructions": "Be brief.",
            "max_output_tokens": 5,
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "add"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        },
    )
    history = output_messages([{"type": "message", "content": [{"type": "output_text", "text": "earlier"}]}])
    chat = parse_request(ChatCompletionRequest, request.chat_body(history))
    assert [m.text() for m in chat.messages] == ["Be brief.", "earlier", "hi"]
    assert chat.max_completion_tokens == 5 and chat.tool_mode == "named"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


def test_a_chained_turn_keeps_text_and_calls_not_reasoning() -> None:
    output = [
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"},
    ]
    [turn] = output_messages(output)
    assert turn["content"] is None and turn["tool_calls"][0]["function"] == {"name": "add", "arguments": "{}"}
