"""OpenAI's Responses API bodies, and their translation to and from a chat request.

A response is a chat completion told differently: its `input` items and `instructions` become
chat messages, its function tools and `text.format` the chat's tools and `response_format`, so
both routes share one path to the engine (`chat.plan_chat`): the same template, tool call
readers, reasoning parser and structured outputs. Its output is a list of items instead of a
message: a `reasoning` item (with `--reasoning-parser`), a `message` with `output_text`, and one
`function_call` item per call.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from moeserve.api.errors import APIError
from moeserve.api.protocol import OpenAIModel


def item_id(prefix: str) -> str:
    """An OpenAI-style item id: `resp_`, `msg_`, `rs_` or `fc_` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    """A user message's text, or items: messages (`role`, `content` as text or `input_text`
    parts), `function_call`s a previous output made and `function_call_output`s answering them;
    `reasoning` items are accepted and left out of the prompt, as templates drop past thinking."""
    instructions: str | None = None
    """A system message first; not carried over to responses chained after this one."""
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The equivalent /v1/chat/completions body, continuing `history` (a chained response's
        messages)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages + history + self.input_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages; consecutive function calls become one assistant turn."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_messages(self.input)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise APIError(f"{where}.content: only text parts are supported", param="input")
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    raise APIError(f"{where}.content must be a string or a list of text parts", param="input")


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(f"{where}.{key} must be a string", param="input")
    return value


def input_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role must be user, system, developer or assistant", param="input")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": content})
        elif kind != "reasoning":
            raise APIError(f"{where}.type {kind!r} is not supported", param="input")
    return messages


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat message a chained response's template sees: its
    text and calls (reasoning is left out, as templates drop past thinking)."""
    texts = [part["text"] for item in output if item["type"] == "message" for part in item["content"]]
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


# ---------------------------------------------------------------- output items


def reasoning_item(id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text_part(text)]
    return {"id": id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseObject(BaseModel):
    """A response, as `responses.create` returns it and `GET /v1/responses/{id}` finds it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[dict[str, Any]] = Field(default_factory=list)
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: dict[str, Any] | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


def response_shell(response_id: str, model: str, request: ResponsesRequest, created_at: int) -> ResponseObject:
    """The response before its output: what `response.created` carries, and the frame of the last one."""
    return ResponseObject(
        id=response_id,
        created_at=created_at,
        model=model,
        status="in_progress",
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=request.parallel_tool_calls,
        previous_response_id=request.previous_response_id,
        temperature=request.temperature,
        top_p=request.top_p,
        tool_choice=(
            request.tool_choice.model_dump()
            if isinstance(request.tool_choice, NamedFunctionChoice)
            else request.tool_choice or ("auto" if request.tools else "none")
        ),
        tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
        text=(
            {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)}
            if request.text is not None and request.text.format is not None
            else {"format": {"type": "text"}}
        ),
        store=request.store,
        metadata=request.metadata or {},
        user=request.user,
    )


def finish(shell: ResponseObject, output: list[dict[str, Any]], finish_reason: str | None, usage: dict) -> None:
    """Complete `shell`: a sample cut at `max_output_tokens` leaves the response incomplete."""
    shell.output = output
    shell.usage = usage
    if finish_reason == "length":
        shell.status = "incomplete"
        shell.incomplete_details = {"reason": "max_output_tokens"}
    else:
        shell.status = "completed"


def response_usage(input_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; prompt caching's tokens are not reported per request, so they read 0."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
