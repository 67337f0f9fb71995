"""POST /v1/responses, and GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the
chat path (`responses_protocol` says how a response maps to a chat request).

A stream sends OpenAI's typed events, each as `event: TYPE` + `data: {...}` with a
`sequence_number`: `response.created`, `response.in_progress`, then per output item
`response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.output_text.delta` inside a content part, `response.function_call_arguments.delta`)
and their `.done` events, `response.output_item.done`; last `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it) with the whole response.
"""

from __future__ import annotations

import json
import time
from bisect import bisect_left
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from moeserve.api.chat import ChatPlan, plan_chat
from moeserve.api.errors import APIError
from moeserve.api.generation import EventStreamResponse, check_model, collect, log_finished, submit_all
from moeserve.api.protocol import ChatCompletionRequest, DeltaToolCall, parse_request
from moeserve.api.response_store import StoredResponse
from moeserve.api.responses_protocol import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    finish,
    function_call_item,
    item_id,
    message_item,
    output_messages,
    output_text_part,
    reasoning_item,
    response_shell,
    response_usage,
)
from moeserve.api.state import ModelInfo, ServingState
from moeserve.api.streaming import SampleCursor
from moeserve.api.transport import read_body
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.streams import RequestStream

_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}
"""Chat request fields -> the Responses fields they came from, for a 400's `param`."""


def _renamed(error: APIError) -> APIError:
    error.param = _PARAMS.get(error.param or "", error.param)
    return error


def _previous(request: ResponsesRequest, state: ServingState) -> StoredResponse | None:
    """The stored response `previous_response_id` names; a 404 if it is not stored, saying
    whether it was evicted."""
    if request.previous_response_id is None:
        return None
    stored = state.responses.get(request.previous_response_id)
    if stored is None:
        message = state.responses.missing(request.previous_response_id, "Previous response")
        raise APIError(message, status_code=404, param="previous_response_id")
    return stored


async def create_response(raw: Request, state: ServingState) -> Response:
    request = parse_request(ResponsesRequest, await read_body(raw, state.settings.max_body_bytes))
    check_model(request.model, state)
    engine, model = state.admit()
    previous = _previous(request, state)
    history = [] if previous is None else previous.messages
    try:
        chat = parse_request(ChatCompletionRequest, request.chat_body(history))
        plan = await plan_chat(raw, chat, state, model, chat.to_sampling_params(default_max_tokens=None))
    except APIError as exc:
        raise _renamed(exc) from None
    response_id = item_id("resp")
    prompt = {"prompt_token_ids": plan.prompt_ids}
    streams = await submit_all(state, engine, [prompt], plan.params, response_id, "input")
    shell = response_shell(response_id, state.settings.served_model_name, request, int(time.time()))
    # What this response adds to its chain: its input after the history (stored once, by the
    # predecessor); its instructions are not carried over to a chained response.
    messages = chat.model_dump(exclude_none=True)["messages"][(request.instructions is not None) + len(history) :]
    if request.stream:
        events = _stream_events(streams[0], request, plan, shell, messages, previous, state, model)
        return EventStreamResponse(events, streams, response_id)
    output = (await collect(raw, streams, response_id))[0]
    sample = output.outputs[0]
    reasoning, content, calls, _ = plan.read(sample.text, sample.finish_reason)
    status = "incomplete" if sample.finish_reason == "length" else "completed"
    items = []
    if reasoning is not None:  # complete once the answer began, as a stream closes it
        items.append(reasoning_item(item_id("rs"), reasoning, status if content is None and not calls else "completed"))
    if content is not None:
        items.append(message_item(item_id("msg"), content, status))
    items += [
        function_call_item(item_id("fc"), c.id, c.function.name, c.function.arguments, "completed") for c in calls
    ]
    finish(shell, items, sample.finish_reason, _usage(output, plan, model))
    _store(state, request, shell, messages, previous)
    return JSONResponse(shell.model_dump())


def _usage(output: RequestOutput, plan: ChatPlan, model: ModelInfo) -> dict[str, Any]:
    """Token counts. The engine does not know which side of `</think>` a token fell: the
    reasoning's are the fewest tokens whose text reaches the end of `</think>` (all of them if
    the thinking never closed), found by decoding prefixes (a binary search)."""
    sample = output.outputs[0]
    reasoning_tokens = 0
    if plan.reasoning is not None and plan.read(sample.text, sample.finish_reason)[0] is not None:
        end = sample.text.find(plan.reasoning.end_marker)
        ids = sample.token_ids
        reasoning_tokens = len(ids)
        if end >= 0:
            reach = end + len(plan.reasoning.end_marker)

            def decoded(k: int) -> int:
                return len(model.tokenizer.decode(ids[:k]))

            reasoning_tokens = bisect_left(range(len(ids) + 1), reach, key=decoded)
    return response_usage(len(output.prompt_token_ids), len(sample.token_ids), reasoning_tokens)


def _store(
    state: ServingState,
    request: ResponsesRequest,
    shell: ResponseObject,
    messages: list[dict[str, Any]],
    previous: StoredResponse | None,
) -> None:
    """Keep the response (with `store`): `messages`, this response's input, and its output
    continue `previous`'s conversation."""
    if request.store:
        state.responses.put(shell.id, shell.model_dump(), messages + output_messages(shell.output), previous)


async def get_response(raw: Request, state: ServingState) -> Response:
    stored = state.responses.get(raw.path_params["response_id"])
    if stored is None:
        raise _not_found(raw.path_params["response_id"], state)
    return JSONResponse(stored.body)


async def delete_response(raw: Request, state: ServingState) -> Response:
    response_id = raw.path_params["response_id"]
    if not state.responses.delete(response_id):
        raise _not_found(response_id, state)
    return JSONResponse(ResponseDeleted(id=response_id).model_dump())


def _not_found(response_id: str, state: ServingState) -> APIError:
    return APIError(state.responses.missing(response_id), status_code=404, param="response_id")


class _Events:
    """Typed SSE events, numbered in the order they are sent."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


class _OutputItems:
    """The output items of a stream: each opens with its first piece and closes when the next
    item opens or the sample ends; `done` holds the closed ones, as the final response lists them."""

    def __init__(self, events: _Events) -> None:
        self.events = events
        self.done: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None
        self.buffer = ""

    def _where(self) -> dict[str, Any]:
        assert self.current is not None
        return {"item_id": self.current["id"], "output_index": len(self.done)}

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self.close("completed")
        self.current, self.buffer = item, ""
        out.append(self.events("response.output_item.added", output_index=len(self.done), item=item))
        part = {"reasoning": {"type": "reasoning_text", "text": ""}, "message": output_text_part("")}.get(item["type"])
        if part is not None:
            out.append(self.events("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def reasoning(self, text: str) -> list[str]:
        out = (
            []
            if self.current is not None and self.current["type"] == "reasoning"
            else self._open(reasoning_item(item_id("rs"), "", "in_progress") | {"content": []})
        )
        self.buffer += text
        return [*out, self.events("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]

    def text(self, text: str) -> list[str]:
        opened = self.current is not None and self.current["type"] == "message"
        out = [] if opened else self._open(message_item(item_id("msg"), None, "in_progress"))
        self.buffer += text
        delta = self.events("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[])
        return [*out, delta]

    def call(self, delta: DeltaToolCall) -> list[str]:
        out = []
        if delta.id is not None:  # a call's first delta: its id and name
            item = function_call_item(item_id("fc"), delta.id, delta.function.name or "", "", "in_progress")
            out = self._open(item)
        arguments = delta.function.arguments or ""
        if arguments:
            self.buffer += arguments
            out.append(self.events("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return out

    def close(self, status: str) -> list[str]:
        """Close the open item (if any) with `status`."""
        item = self.current
        if item is None:
            return []
        where, text, out = self._where(), self.buffer, []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            part = done["content"][0]
            out.append(self.events("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.events("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "message":
            done = message_item(item["id"], text, status)
            out.append(self.events("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.events("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        else:
            done = function_call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out.append(self.events("response.function_call_arguments.done", **where, arguments=text))
        out.append(self.events("response.output_item.done", output_index=where["output_index"], item=done))
        self.done.append(done)
        self.current = None
        return out


async def _stream_events(
    stream: RequestStream,
    request: ResponsesRequest,
    plan: ChatPlan,
    shell: ResponseObject,
    messages: list[dict[str, Any]],
    previous: StoredResponse | None,
    state: ServingState,
    model: ModelInfo,
) -> AsyncIterator[str]:
    events = _Events()
    yield events("response.created", response=shell.model_dump())
    yield events("response.in_progress", response=shell.model_dump())
    items = _OutputItems(events)
    cursor = SampleCursor(plan.params)
    thought = plan.reasoning_stream()
    calls = None if plan.reader is None else plan.reader.stream()
    final = None
    async for output in stream:
        sample = output.outputs[0]
        delta = cursor.advance(sample)
        if output.finished:
            final = output
        if delta is None:
            continue
        ending = delta.finish_reason is not None
        out: list[str] = []
        text = delta.text
        if thought is not None:
            reasoning, text = thought.update(text, ending)
            if reasoning:
                out += items.reasoning(reasoning)
        call_deltas: list[DeltaToolCall] = []
        if calls is not None:
            text, call_deltas = calls.update(text, ending)
        if text:
            out += items.text(text)
        for call_delta in call_deltas:
            out += items.call(call_delta)
        if ending:
            out += items.close("incomplete" if delta.finish_reason == "length" else "completed")
        if out:
            yield "".join(out)
    if final is None:  # aborted by the server (shutdown): the response stays in progress, and says so
        yield events("error", code="server_shutdown", message="the server is shutting down", param=None)
        return
    sample = final.outputs[0]
    finish(shell, items.done, sample.finish_reason, _usage(final, plan, model))
    _store(state, request, shell, messages, previous)
    kind = "response.incomplete" if shell.status == "incomplete" else "response.completed"
    yield events(kind, response=shell.model_dump())
    log_finished(shell.id, [final], streamed=True)
